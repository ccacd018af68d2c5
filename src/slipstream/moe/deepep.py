"""`deepep` dispatcher: the `Dispatcher` protocol on DeepEP's kernels (`deep_ep.Buffer`).

NEVER RUN. Written against the public `deep_ep.Buffer` API of DeepEP at the commit that
deploy/Dockerfile.gpu pins (b306af06afd412c88e51e71802951606e40b7358, "EPv2"; `deep_ep.Buffer`
there is the V1 "legacy" buffer: deep_ep/buffers/legacy.py). The development machines have no
GPU, no NVLink, no RDMA and no DeepEP build, and DeepEP needs at least 2 GPUs, so the kernels
were never called from here. What is tested (tests/unit/test_moe_deepep.py,
tests/integration/test_moe_ep_deepep.py) is the mapping onto that API, against a FAKE Buffer
that reimplements DeepEP's documented semantics with torch.distributed (gloo), and the refusal
paths.

Shape legend: N tokens on this rank, D hidden, K top-k, E experts, R ranks, E_r = E / R local
experts, T tokens received by this rank (normal mode: one copy per (token, destination rank)),
M rows handed to the local experts (one per (token, local expert)), C = max tokens per rank x R
(low-latency receive capacity per local expert).

Modes (constructor `mode`):
- "normal" (training, prefill): `get_dispatch_layout` then `dispatch` with routing ids and
  weights; DeepEP sends one copy of a token per destination rank (over NVLink inside a node; one
  RDMA copy per destination node, forwarded over NVLink, between nodes). Each received token is
  expanded here into one row per local expert it selected (`recv_topk_idx` >= 0). `combine`
  weights the rows by the received routing weights, sums them per received token (fp32), and
  DeepEP's `combine` adds the per-rank partial sums at the source (it does not weight).
  Autograd: the backward of dispatch is DeepEP's combine (with the routing-weight gradients),
  the backward of combine is a cached-handle dispatch, as DeepEP's docs prescribe.
- "low_latency" (decode): `low_latency_dispatch` (bf16, no FP8) into per-expert packed buffers,
  one copy per (token, expert); rows are gathered out of the packed layout, and `combine` writes
  the expert outputs back into it for `low_latency_combine`, which weights and sums at the
  source. Inference only: DeepEP has no backward for it, so a dispatch that needs gradients is
  refused. At most `num_max_dispatch_tokens_per_rank` tokens per call.

Activations travel as bf16 (DeepEP's kernels move bf16 rows): float32/float16 inputs are cast
for the wire (one logged warning) and the received rows and the combined output come back in
the caller's dtype, so the layer works under bf16 autocast with a float32 residual stream.

Refusals (clear errors instead of kernel asserts): `deep_ep` not importable
(`DeepEPUnavailable`, a ValueError like an unknown dispatcher type); tensors not on CUDA;
non-floating activations; an EP layout DeepEP's kernels do not support (R < 2; normal mode: R
in the kernels' tuned set and ranks_per_node = min(R, 8), since DeepEP treats 8 consecutive
ranks as one NVLink node); low-latency calls with too many tokens or with gradients.

Byte meter: payload = one bf16 row per logical copy (normal: per (token, destination rank);
low-latency: per (token, expert)), meta = the top-k ids (int64) and weights (fp32) that normal
dispatch carries per copy, plus the per-rank count exchange. Between nodes DeepEP's normal
kernels send one RDMA copy per (token, node), so the metered inter-node rows are an upper bound
of its RDMA rows (the `hierarchical` dispatcher shows what that dedup saves). Normal dispatch
adds one all-to-all of R int64 counts (through `Channel.exchange_counts`) that DeepEP itself does
not need: it gives the meter the rows combine sends back and checks the received row count.

Not covered: FP8 dispatch, async/overlapped kernels and receive hooks, CUDA graphs
(`num_worst_tokens`), the V2 `ElasticBuffer` API, shrink/mask mode, MNNVL, tuned `Config`s.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from slipstream.moe.base import BaseDispatcher, HandleBase
from slipstream.moe.meter import ByteMeter
from slipstream.moe.rank_layout import EPGroup

MODES = ("normal", "low_latency")
NVL_PEERS = 8
"""DeepEP's legacy kernels: at most 8 NVLink peers; 8 consecutive ranks form one node."""
NORMAL_WORLD_SIZES = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160)
"""EP sizes with a tuned dispatch/combine Config in `Buffer.get_dispatch_config` (pinned commit)."""
PINNED_COMMIT = "b306af06afd412c88e51e71802951606e40b7358"
PAYLOAD_DTYPE = torch.bfloat16
log = logging.getLogger(__name__)
_warned: set[torch.dtype] = set()


class DeepEPUnavailable(ValueError):
    """The `deepep` dispatcher cannot be used here (DeepEP missing, or an unsupported setting).
    A ValueError, as `make_dispatcher` raises for a type that cannot be built."""


def import_deep_ep() -> Any:
    """The `deep_ep` module, or DeepEPUnavailable saying why it cannot be imported."""
    try:
        return importlib.import_module("deep_ep")
    except (ImportError, OSError) as e:  # not installed, or its CUDA/NCCL/NVSHMEM libs missing
        raise DeepEPUnavailable(
            f"dispatcher type 'deepep' needs DeepEP's `deep_ep` package, which is not importable "
            f"here ({type(e).__name__}: {e}). It is built against CUDA, NCCL and NVSHMEM in the "
            f"GPU image (deploy/Dockerfile.gpu, DeepEP {PINNED_COMMIT[:12]}); elsewhere use "
            f"'exact' or 'hierarchical'."
        ) from e


@dataclass
class DeepEPHandle(HandleBase):
    """What combine needs from dispatch. `rows_M` indexes the received tokens (normal) or the
    flattened (local expert, slot) packed layout (low_latency) for each row handed out."""

    mode: str
    ep_handle: Any
    buffer: Any
    rows_M: torch.Tensor
    topk_col_M: torch.Tensor | None = None
    recv_w_TK: torch.Tensor | None = None
    num_recv: int = 0
    send_counts: list[int] = field(default_factory=list)
    recv_counts: list[int] = field(default_factory=list)
    topk_idx_NK: torch.Tensor | None = None
    topk_w_NK: torch.Tensor | None = None
    packed_shape: tuple[int, ...] = ()


class _NormalDispatch(torch.autograd.Function):
    """DeepEP normal dispatch; backward = DeepEP combine of the gradients (its docs' recipe).
    `out` receives the non-tensor results (handle, per-expert counts)."""

    @staticmethod
    def forward(ctx, x_ND, w_NK, buffer, layout, topk_idx_NK, out):  # type: ignore[override]
        per_rank, per_rdma_rank, per_expert, in_rank = layout
        recv_x, recv_idx, recv_w, per_expert_list, ep_handle, _event = buffer.dispatch(
            x_ND, topk_idx=topk_idx_NK, topk_weights=w_NK, num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
        )  # fmt: skip
        ctx.buffer, ctx.ep_handle = buffer, ep_handle
        out["ep_handle"], out["per_expert"] = ep_handle, list(per_expert_list)
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_idx, recv_w

    @staticmethod
    def backward(ctx, g_x, _g_idx, g_w):  # type: ignore[override]
        grad_x, grad_w, _event = ctx.buffer.combine(
            g_x.to(PAYLOAD_DTYPE).contiguous(), ctx.ep_handle, topk_weights=g_w.float().contiguous()
        )
        return grad_x, grad_w, None, None, None, None


class _NormalCombine(torch.autograd.Function):
    """DeepEP normal combine (sum of the ranks' rows at the source); backward = cached dispatch."""

    @staticmethod
    def forward(ctx, z_TD, buffer, ep_handle):  # type: ignore[override]
        out_ND, _w, _event = buffer.combine(z_TD, ep_handle)
        ctx.buffer, ctx.ep_handle = buffer, ep_handle
        return out_ND

    @staticmethod
    def backward(ctx, g_out):  # type: ignore[override]
        result = ctx.buffer.dispatch(g_out.to(PAYLOAD_DTYPE).contiguous(), handle=ctx.ep_handle)
        return result[0], None, None


class DeepEPDispatcher(BaseDispatcher):
    """`Dispatcher` on DeepEP (see the module docstring; never run on real kernels).

    Options (via `make_dispatcher("deepep", group, meter, **options)`):
    - `mode`: "normal" (default) or "low_latency".
    - `num_max_dispatch_tokens_per_rank`: low_latency's per-call token limit (same on all ranks).
    - `num_sms`: SMs for the normal kernels (`Buffer.set_num_sms`, even); None keeps DeepEP's.
    - `backend`: the `deep_ep` module to use; None imports it. Tests pass a fake.
    - `require_cuda`: refuse tensors not on CUDA (default). False only with a fake backend: the
      real kernels need CUDA tensors.
    The communication buffer is allocated at the first dispatch (collective, like every call)
    for that call's hidden size, and again if a later call's hidden size needs more.
    """

    type = "deepep"

    def __init__(
        self,
        group: EPGroup,
        meter: ByteMeter | None = None,
        *,
        mode: str = "normal",
        num_max_dispatch_tokens_per_rank: int = 128,
        num_sms: int | None = None,
        backend: Any = None,
        require_cuda: bool = True,
    ) -> None:
        self.ep = backend if backend is not None else import_deep_ep()
        if mode not in MODES:
            raise ValueError(f"deepep mode={mode!r}; expected one of {MODES}")
        _check_layout(group, mode)
        if num_max_dispatch_tokens_per_rank < 1:
            raise ValueError(
                f"num_max_dispatch_tokens_per_rank={num_max_dispatch_tokens_per_rank}: need >= 1"
            )
        if num_sms is not None:
            if num_sms < 2 or num_sms % 2:
                raise ValueError(f"deepep num_sms={num_sms}: DeepEP needs an even count >= 2")
            self.ep.Buffer.set_num_sms(num_sms)
        super().__init__(group, meter)
        self.mode = mode
        self.max_tokens = num_max_dispatch_tokens_per_rank
        self.require_cuda = require_cuda
        self.buffer: Any = None
        self._buffer_hidden = 0

    # ---- buffer --------------------------------------------------------------------------------

    def _ensure_buffer(self, hidden: int) -> Any:
        """The DeepEP Buffer for rows of `hidden` bf16 values (collective when it is created)."""
        if self.buffer is not None and hidden <= self._buffer_hidden:
            return self.buffer
        Buffer, R, E = self.ep.Buffer, self.topo.world_size, self.topo.num_experts
        if self.mode == "normal":
            hidden_bytes = hidden * 2  # bf16 rows (DeepEP's docs: hidden x max(elem size, 2))
            configs = (Buffer.get_dispatch_config(R), Buffer.get_combine_config(R))
            nvl = max(c.get_nvl_buffer_size_hint(hidden_bytes, R) for c in configs)
            rdma = max(c.get_rdma_buffer_size_hint(hidden_bytes, R) for c in configs)
            self.buffer = Buffer(self.group.world, nvl, rdma)
        else:
            rdma = Buffer.get_low_latency_rdma_size_hint(self.max_tokens, hidden, R, E)
            # DeepEP's advice: one queue pair per local expert
            self.buffer = Buffer(
                self.group.world, 0, rdma, low_latency_mode=True,
                num_qps_per_rank=self.topo.experts_per_rank,
            )  # fmt: skip
        self._buffer_hidden = hidden
        return self.buffer

    # ---- checks --------------------------------------------------------------------------------

    def _check_tensors(self, x_ND: torch.Tensor, idx_NK: torch.Tensor, w_NK: torch.Tensor) -> None:
        if self.require_cuda:
            bad = [(n, t.device) for n, t in (("x", x_ND), ("topk_idx", idx_NK), ("topk_w", w_NK))
                   if t.device.type != "cuda"]  # fmt: skip
            if bad:
                raise ValueError(
                    "deepep dispatch: DeepEP's kernels need CUDA tensors; got "
                    + ", ".join(f"{n} on {d}" for n, d in bad)
                )
        if not x_ND.is_floating_point():
            raise ValueError(f"deepep dispatch: x is {x_ND.dtype}; expected floating activations")
        if x_ND.dtype != PAYLOAD_DTYPE and x_ND.dtype not in _warned:
            _warned.add(x_ND.dtype)
            log.warning("deepep: %s activations travel as bfloat16 (DeepEP's kernels)", x_ND.dtype)

    # ---- protocol ------------------------------------------------------------------------------

    def dispatch(
        self, x_ND: torch.Tensor, topk_idx_NK: torch.Tensor, topk_w_NK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, DeepEPHandle]:
        self._check(x_ND, topk_idx_NK, topk_w_NK)
        self._check_tensors(x_ND, topk_idx_NK, topk_w_NK)
        if self.mode == "low_latency":
            return self._ll_dispatch(x_ND, topk_idx_NK, topk_w_NK)
        return self._normal_dispatch(x_ND, topk_idx_NK, topk_w_NK)

    def combine(self, y_MD: torch.Tensor, handle: DeepEPHandle) -> torch.Tensor:
        self._check_y(y_MD, handle, handle.rows_M.numel())
        if handle.mode == "low_latency":
            return self._ll_combine(y_MD, handle)
        return self._normal_combine(y_MD, handle)

    # ---- normal mode ---------------------------------------------------------------------------

    def _normal_dispatch(
        self, x_ND: torch.Tensor, topk_idx_NK: torch.Tensor, topk_w_NK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, DeepEPHandle]:
        N, K = topk_idx_NK.shape
        D = x_ND.shape[1]
        buffer = self._ensure_buffer(D)
        idx_NK = topk_idx_NK.to(self.ep.topk_idx_t)
        w_NK = topk_w_NK.float()
        per_rank, per_rdma_rank, per_expert, in_rank, _event = buffer.get_dispatch_layout(
            idx_NK, self.topo.num_experts
        )
        self.meter.start_call("dispatch")
        send = [int(c) for c in per_rank.tolist()]
        recv = self.world.exchange_counts(send, "dispatch", x_ND.device)
        out: dict[str, Any] = {}
        layout = (per_rank, per_rdma_rank, per_expert, in_rank)
        recv_x_TD, recv_idx_TK, recv_w_TK = _NormalDispatch.apply(
            x_ND.to(PAYLOAD_DTYPE).contiguous(), w_NK, buffer, layout, idx_NK, out
        )
        if recv_x_TD.shape[0] != sum(recv):
            raise RuntimeError(
                f"deepep dispatch: DeepEP delivered {recv_x_TD.shape[0]} tokens to rank "
                f"{self.group.rank}, but the ranks' layouts say {sum(recv)} ({recv})"
            )
        peers = list(range(self.topo.world_size))
        self.meter.add("dispatch", "payload", self.topo, self.group.rank, peers, send, D * 2)
        self.meter.add("dispatch", "meta", self.topo, self.group.rank, peers, send, K * (8 + 4))
        # one row per (received token, local expert it chose); row-major: token, then column
        tok_M, col_M = torch.nonzero(recv_idx_TK >= 0, as_tuple=True)
        if sum(out["per_expert"]) != tok_M.numel():
            raise RuntimeError(
                f"deepep dispatch: DeepEP counts {sum(out['per_expert'])} rows for the local "
                f"experts but its recv_topk_idx holds {tok_M.numel()}"
            )
        recv_x_MD = recv_x_TD.index_select(0, tok_M).to(x_ND.dtype)
        local_M = recv_idx_TK[tok_M, col_M].long()
        handle = DeepEPHandle(
            N, self._needs_grad(x_ND, topk_w_NK), "normal", out["ep_handle"], buffer, tok_M,
            topk_col_M=col_M, recv_w_TK=recv_w_TK, num_recv=recv_x_TD.shape[0],
            send_counts=send, recv_counts=recv,
        )  # fmt: skip
        return recv_x_MD, local_M, handle

    def _normal_combine(self, y_MD: torch.Tensor, handle: DeepEPHandle) -> torch.Tensor:
        assert handle.recv_w_TK is not None and handle.topk_col_M is not None
        self.meter.start_call("combine")
        D = y_MD.shape[1]
        w_M = handle.recv_w_TK[handle.rows_M, handle.topk_col_M]
        # weighted per-token partial sums of this rank's experts, accumulated in fp32
        z_TD = y_MD.new_zeros((handle.num_recv, D), dtype=torch.float32).index_add(
            0, handle.rows_M, y_MD.float() * w_M[:, None]
        )
        out_ND = _NormalCombine.apply(z_TD.to(PAYLOAD_DTYPE), handle.buffer, handle.ep_handle)
        peers = list(range(self.topo.world_size))
        self.meter.add(
            "combine", "payload", self.topo, self.group.rank, peers, handle.recv_counts, D * 2
        )
        return out_ND.to(y_MD.dtype)

    # ---- low-latency mode ----------------------------------------------------------------------

    def _ll_dispatch(
        self, x_ND: torch.Tensor, topk_idx_NK: torch.Tensor, topk_w_NK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, DeepEPHandle]:
        N, D = x_ND.shape
        if self._needs_grad(x_ND, topk_w_NK):
            raise RuntimeError(
                "deepep low_latency mode is inference-only (decode): DeepEP has no backward for "
                "it; run under torch.no_grad(), or use mode='normal' for training"
            )
        if N > self.max_tokens:
            raise ValueError(
                f"deepep low_latency dispatch: {N} tokens exceed "
                f"num_max_dispatch_tokens_per_rank={self.max_tokens}"
            )
        buffer = self._ensure_buffer(D)
        idx_NK = topk_idx_NK.to(self.ep.topk_idx_t)
        self.meter.start_call("dispatch")
        packed_x, count_E, ep_handle, _event, _hook = buffer.low_latency_dispatch(
            x_ND.to(PAYLOAD_DTYPE).contiguous(), idx_NK, self.max_tokens, self.topo.num_experts,
            use_fp8=False, async_finish=False, return_recv_hook=False,
        )  # fmt: skip
        E_r, C = packed_x.shape[0], packed_x.shape[1]
        counts = [int(c) for c in count_E.tolist()]
        dev = x_ND.device
        slots = [torch.arange(c, device=dev) + e * C for e, c in enumerate(counts)]
        flat_M = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.long, device=dev)
        local_M = torch.repeat_interleave(
            torch.arange(E_r, device=dev), torch.tensor(counts, device=dev)
        )
        recv_x_MD = packed_x.reshape(E_r * C, D).index_select(0, flat_M).to(x_ND.dtype)
        # one copy per (token, expert) to the expert's owner
        send = torch.bincount(
            self.topo.owner_rank(topk_idx_NK.reshape(-1)), minlength=self.topo.world_size
        ).tolist()
        recv = _ll_recv_counts(ep_handle, counts, self.topo.world_size)
        peers = list(range(self.topo.world_size))
        self.meter.add("dispatch", "payload", self.topo, self.group.rank, peers, send, D * 2)
        handle = DeepEPHandle(
            N, False, "low_latency", ep_handle, buffer, flat_M, num_recv=flat_M.numel(),
            send_counts=send, recv_counts=recv, topk_idx_NK=idx_NK, topk_w_NK=topk_w_NK.float(),
            packed_shape=tuple(packed_x.shape),
        )  # fmt: skip
        return recv_x_MD, local_M, handle

    def _ll_combine(self, y_MD: torch.Tensor, handle: DeepEPHandle) -> torch.Tensor:
        self.meter.start_call("combine")
        E_r, C, D = handle.packed_shape
        packed_y = y_MD.new_zeros((E_r * C, D), dtype=PAYLOAD_DTYPE)
        packed_y[handle.rows_M] = y_MD.to(PAYLOAD_DTYPE)
        out_ND, _event, _hook = handle.buffer.low_latency_combine(
            packed_y.view(E_r, C, D), handle.topk_idx_NK, handle.topk_w_NK, handle.ep_handle,
            async_finish=False, return_recv_hook=False,
        )  # fmt: skip
        peers = list(range(self.topo.world_size))
        self.meter.add(
            "combine", "payload", self.topo, self.group.rank, peers, handle.recv_counts, D * 2
        )
        return out_ND.to(y_MD.dtype)


def _ll_recv_counts(ep_handle: Any, counts_E: list[int], world_size: int) -> list[int]:
    """Rows received from each source rank, read off the low-latency handle. Layout at the pinned
    commit (DeepEP's tests/legacy/test_low_latency.py): handle[1] is `layout_range`
    (E_r, R) int64 with begin << 32 | count per (local expert, source rank). Checked against the
    per-expert receive counts, so a changed layout fails loudly instead of mis-metering."""
    layout_ER = ep_handle[1]
    if tuple(layout_ER.shape) != (len(counts_E), world_size):
        raise RuntimeError(
            f"deepep: low-latency handle[1] has shape {tuple(layout_ER.shape)}, expected "
            f"({len(counts_E)}, {world_size}) (DeepEP {PINNED_COMMIT[:12]} layout_range)"
        )
    per_ER = (layout_ER & 0xFFFFFFFF).long()
    if per_ER.sum(1).tolist() != counts_E:
        raise RuntimeError(
            f"deepep: low-latency layout_range counts {per_ER.sum(1).tolist()} disagree with "
            f"packed_recv_count {counts_E} (DeepEP {PINNED_COMMIT[:12]} layout assumed)"
        )
    return per_ER.sum(0).tolist()


def _check_layout(group: EPGroup, mode: str) -> None:
    """Refuse EP layouts DeepEP's kernels cannot run, before any buffer or collective."""
    t = group.topo
    R = t.world_size
    if R < 2:
        raise DeepEPUnavailable(
            f"deepep: EP world size {R}; DeepEP's kernels need at least 2 ranks (GPUs)"
        )
    if mode == "low_latency":
        return  # every rank is reached over RDMA (or NVLink when allowed): any node split
    if R not in NORMAL_WORLD_SIZES:
        raise DeepEPUnavailable(
            f"deepep normal mode: EP world size {R} has no tuned DeepEP config; "
            f"supported: {NORMAL_WORLD_SIZES}"
        )
    expect = (1, R) if R <= NVL_PEERS else (R // NVL_PEERS, NVL_PEERS)
    if (t.num_nodes, t.ranks_per_node) != expect:
        raise DeepEPUnavailable(
            f"deepep normal mode: topology {t.num_nodes} nodes x {t.ranks_per_node} ranks, but "
            f"DeepEP treats {NVL_PEERS} consecutive ranks as one NVLink node: for {R} ranks use "
            f"{expect[0]} x {expect[1]}"
        )
