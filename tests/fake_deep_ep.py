"""A FAKE `deep_ep` module for testing slipstream's `deepep` dispatcher without DeepEP or GPUs.

`FakeDeepEP` stands in for the `deep_ep` module (passed explicitly as the dispatcher's `backend`);
its `FakeBuffer` mirrors the public signatures of `deep_ep.Buffer` at the pinned commit
(b306af06, deep_ep/buffers/legacy.py: same argument names and defaults, keyword-only where our
code must pass keywords) and reimplements the documented semantics with torch.distributed
all-to-alls (gloo on CPU), as read from DeepEP's docs/legacy.md and tests/legacy/test_intranode.py
and test_low_latency.py:
- get_dispatch_layout: per-rank / per-expert token counts and is_token_in_rank (a token counts
  once per destination rank);
- dispatch: one copy per (token, destination rank), received in source-rank order; recv_topk_idx
  holds LOCAL expert ids or -1; cached mode (handle=...) moves x only;
- combine: sums the rows of each token over ranks at its source, WITHOUT weights (the weights
  passed in are summed the same way);
- low_latency_dispatch/combine: one copy per (token, expert) into per-expert packed buffers
  (E_r, max_tokens x R, D) with counts and handle (src_info, layout_range, ...), layout_range =
  begin << 32 | count per (expert, source); combine weights and sums at the source.
It records every call (`calls`) so tests can check what the dispatcher passed. What it cannot
show: that the real kernels behave this way (they were never run here), performance, or any
CUDA/NVSHMEM/RDMA behaviour. Not a test module (nothing to collect).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class FakeConfig:
    """deep_ep.Config: only the size hints the dispatcher asks for."""

    num_sms: int
    nvl_chunk: int

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return self.num_sms * self.nvl_chunk * hidden_bytes * num_ranks

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0 if num_ranks <= 8 else self.num_sms * hidden_bytes * num_ranks


class FakeEvent:
    def current_stream_wait(self) -> None:
        pass


@dataclass
class FakeNormalHandle:
    src_tok_S: torch.Tensor  # token index of every row this rank sent, grouped by destination
    send_counts: list[int]
    recv_counts: list[int]
    num_tokens: int


class FakeBuffer:
    num_sms: int = 20
    instances: list[FakeBuffer] = []

    def __init__(self, group: Any, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm: Any = None) -> None:  # fmt: skip
        if group is None:
            raise ValueError("Either 'group' or 'comm' must be provided.")
        self.group = group
        self.rank, self.group_size = group.rank(), group.size()
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.num_qps_per_rank = num_qps_per_rank
        self.calls: list[tuple[str, dict[str, Any]]] = []
        FakeBuffer.instances.append(self)

    # ---- static helpers --------------------------------------------------------------------

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        assert new_num_sms % 2 == 0, "The SM count must be even"
        FakeBuffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> FakeConfig:
        return FakeConfig(FakeBuffer.num_sms, 256)

    @staticmethod
    def get_combine_config(num_ranks: int) -> FakeConfig:
        return FakeConfig(FakeBuffer.num_sms, 128)

    @staticmethod
    def get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        return 2 * num_max_dispatch_tokens_per_rank * hidden * 2 * num_ranks * num_experts

    # ---- plumbing --------------------------------------------------------------------------

    def _a2a(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=self.group)
        return out

    def _counts(self, send: list[int]) -> list[int]:
        t = torch.tensor(send, dtype=torch.int64)
        r = torch.empty_like(t)
        dist.all_to_all_single(r, t, group=self.group)
        return r.tolist()

    def _record(self, name: str, **summary: Any) -> None:
        self.calls.append((name, summary))

    # ---- normal mode -------------------------------------------------------------------------

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Any = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False) -> tuple:  # fmt: skip
        assert topk_idx.dtype == FakeDeepEP.topk_idx_t, topk_idx.dtype
        self._record("get_dispatch_layout", topk_idx_dtype=topk_idx.dtype, num_experts=num_experts)
        R = self.group_size
        per = num_experts // R
        rank_NK = torch.where(topk_idx >= 0, topk_idx // per, -1)
        in_rank_NR = torch.stack([(rank_NK == r).any(1) for r in range(R)], 1)
        valid = topk_idx[topk_idx >= 0]
        per_expert = torch.bincount(valid, minlength=num_experts).int()
        per_rdma = None if R <= 8 else in_rank_NR.view(-1, R // 8, 8).any(2).sum(0).int()
        return in_rank_NR.sum(0).int(), per_rdma, per_expert, in_rank_NR, FakeEvent()

    def dispatch(self, x: torch.Tensor, handle: Any = None, num_tokens_per_rank: Any = None,
                 num_tokens_per_rdma_rank: Any = None, is_token_in_rank: Any = None,
                 num_tokens_per_expert: Any = None, topk_idx: Any = None, topk_weights: Any = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Any = None,
                 previous_event: Any = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False) -> tuple:  # fmt: skip
        assert not self.low_latency_mode, "normal dispatch on a low-latency buffer"
        assert x.dtype == torch.bfloat16, f"x must be bfloat16, got {x.dtype}"
        if handle is not None:  # cached: same layout, x only
            assert topk_idx is None and topk_weights is None
            self._record("dispatch_cached", x_dtype=x.dtype)
            send_x = x.index_select(0, handle.src_tok_S)
            return self._a2a(send_x, handle.send_counts, handle.recv_counts), None, None, None, \
                None, FakeEvent()  # fmt: skip
        assert num_tokens_per_rank is not None and is_token_in_rank is not None
        assert num_tokens_per_expert is not None and topk_idx is not None
        assert topk_weights is not None and topk_weights.dtype == torch.float32
        assert topk_idx.dtype == FakeDeepEP.topk_idx_t
        self._record("dispatch", x_dtype=x.dtype, w_dtype=topk_weights.dtype,
                     expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens,
                     async_finish=async_finish)  # fmt: skip
        R = self.group_size
        per = int(num_tokens_per_expert.numel()) // R
        src_S = torch.cat([torch.nonzero(is_token_in_rank[:, r]).flatten() for r in range(R)])
        send = is_token_in_rank.sum(0).tolist()
        assert send == num_tokens_per_rank.tolist()
        recv = self._counts(send)
        dest_S = torch.repeat_interleave(torch.arange(R), torch.tensor(send))
        idx_SK = topk_idx.index_select(0, src_S)
        # the destination's local expert ids, -1 for experts elsewhere
        local_SK = torch.where(idx_SK // per == dest_S[:, None], idx_SK - dest_S[:, None] * per, -1)
        w_SK = torch.where(local_SK >= 0, topk_weights.index_select(0, src_S), 0.0)
        recv_x = self._a2a(x.index_select(0, src_S), send, recv)
        recv_idx = self._a2a(local_SK, send, recv)
        recv_w = self._a2a(w_SK, send, recv)
        per_expert_list = [int((recv_idx == e).sum()) for e in range(per)]
        h = FakeNormalHandle(src_S, send, recv, x.shape[0])
        return recv_x, recv_idx, recv_w, per_expert_list, h, FakeEvent()

    def combine(self, x: torch.Tensor, handle: FakeNormalHandle, topk_weights: Any = None,
                bias: Any = None, config: Any = None, previous_event: Any = None,
                async_finish: bool = False,
                allocate_on_comm_stream: bool = False) -> tuple:  # fmt: skip
        assert x.dtype == torch.bfloat16, f"x must be bfloat16, got {x.dtype}"
        self._record("combine", x_dtype=x.dtype, with_weights=topk_weights is not None)
        back = self._a2a(x, handle.recv_counts, handle.send_counts)
        out = torch.zeros((handle.num_tokens, x.shape[1]), dtype=torch.float32)
        out.index_add_(0, handle.src_tok_S, back.float())
        out_w = None
        if topk_weights is not None:
            back_w = self._a2a(topk_weights, handle.recv_counts, handle.send_counts)
            out_w = torch.zeros((handle.num_tokens, back_w.shape[1]), dtype=torch.float32)
            out_w.index_add_(0, handle.src_tok_S, back_w.float())
        return out.to(torch.bfloat16), out_w, FakeEvent()

    # ---- low-latency mode --------------------------------------------------------------------

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Any = None,
                             dispatch_wait_recv_cost_stats: Any = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False,
                             return_recv_hook: bool = False) -> tuple:  # fmt: skip
        assert self.low_latency_mode, "low-latency dispatch on a normal buffer"
        if use_fp8:
            raise NotImplementedError("FakeBuffer: FP8 low-latency dispatch is not faked")
        assert x.dtype == torch.bfloat16 and topk_idx.dtype == FakeDeepEP.topk_idx_t
        N, D = x.shape
        assert N <= num_max_dispatch_tokens_per_rank
        self._record("low_latency_dispatch", num_max=num_max_dispatch_tokens_per_rank,
                     num_experts=num_experts, use_fp8=use_fp8, async_finish=async_finish,
                     return_recv_hook=return_recv_hook)  # fmt: skip
        R = self.group_size
        per = num_experts // R
        n_A = torch.arange(N).repeat_interleave(topk_idx.shape[1])
        e_A = topk_idx.reshape(-1)
        keep = e_A >= 0
        n_A, e_A = n_A[keep], e_A[keep]
        order = torch.argsort(e_A, stable=True)  # by owner rank, then expert, then token
        n_A, e_A = n_A[order], e_A[order]
        send = torch.bincount(e_A // per, minlength=R).tolist()
        recv = self._counts(send)
        rx = self._a2a(x.index_select(0, n_A), send, recv)
        rmeta = self._a2a(torch.stack([n_A, e_A - (e_A // per) * per], 1), send, recv)
        src_M = torch.repeat_interleave(torch.arange(R), torch.tensor(recv))
        C = num_max_dispatch_tokens_per_rank * R
        packed = torch.zeros((per, C, D), dtype=torch.bfloat16)
        src_info = torch.full((per, C), -1, dtype=torch.int32)
        layout = torch.zeros((per, R), dtype=torch.int64)
        count = torch.zeros(per, dtype=torch.int32)
        for e in range(per):
            for r in range(R):
                rows = torch.nonzero((rmeta[:, 1] == e) & (src_M == r)).flatten()
                begin = int(count[e])
                packed[e, begin : begin + len(rows)] = rx[rows]
                src_info[e, begin : begin + len(rows)] = rmeta[rows, 0].int()
                layout[e, r] = (begin << 32) | len(rows)
                count[e] += len(rows)
        h = (src_info, layout, num_max_dispatch_tokens_per_rank, D, num_experts)
        return packed, count, h, FakeEvent(), None

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor,
                            topk_weights: torch.Tensor, handle: tuple, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Any = None,
                            combine_wait_recv_cost_stats: Any = None) -> tuple:  # fmt: skip
        assert self.low_latency_mode and x.dtype == torch.bfloat16
        assert topk_weights.dtype == torch.float32
        self._record("low_latency_combine", async_finish=async_finish,
                     return_recv_hook=return_recv_hook, zero_copy=zero_copy)  # fmt: skip
        src_info, layout, _num_max, D, num_experts = handle
        R = self.group_size
        per = num_experts // R
        rows, meta, send = [], [], []
        for r in range(R):
            for e in range(per):
                begin, n = int(layout[e, r]) >> 32, int(layout[e, r]) & 0xFFFFFFFF
                rows.append(x[e, begin : begin + n])
                tok = src_info[e, begin : begin + n].long()
                meta.append(torch.stack([tok, torch.full_like(tok, self.rank * per + e)], 1))
            send.append(sum(len(m) for m in meta) - sum(send))
        recv = self._counts(send)
        back = self._a2a(torch.cat(rows), send, recv).float()
        back_meta = self._a2a(torch.cat(meta), send, recv)
        result = torch.zeros((topk_idx.shape[0], D), dtype=torch.float32)
        for i in range(back.shape[0]):
            n, e = int(back_meta[i, 0]), int(back_meta[i, 1])
            j = int(torch.nonzero(topk_idx[n] == e)[0])
            result[n] += topk_weights[n, j] * back[i]
        return result.to(torch.bfloat16), FakeEvent(), None


class FakeDeepEP:
    """Stands in for the `deep_ep` module (Buffer, topk_idx_t)."""

    Buffer = FakeBuffer
    topk_idx_t = torch.int64
    __version__ = "fake"


# ---- rank-side checks (run in every rank by tests/integration/test_moe_ep_deepep.py) ------------


def _moe(group: Any, block: Any, **opts: Any) -> Any:
    from slipstream.moe import ExpertParallelMoE, make_dispatcher

    disp = make_dispatcher("deepep", group, backend=FakeDeepEP, require_cuda=False, **opts)
    return ExpertParallelMoE(block, disp)


def deepep_checks(group: Any, N: int = 24, D: int = 16, W: int = 8, K: int = 2) -> dict[str, Any]:
    """The `deepep` dispatcher on the fake Buffer against the single-process reference MoE, in
    bf16: normal mode forward + backward (output, input/router/expert gradients), low-latency
    forward; plus what rank-side code passed to the fake (its recorded calls) and the meter."""
    from slipstream.moe.selfcheck import _block, _inputs, _maxdiff, _uneven

    t, r = group.topo, group.rank
    E, R = t.num_experts, t.world_size
    Ns = _uneven(N, R)
    xs, gs = _inputs(Ns, D, 0)
    xs = [x.bfloat16() for x in xs]
    gs = [g.bfloat16() for g in gs]
    ref = _block(D, E, K, W, 0).bfloat16()
    x_all = torch.cat(xs).requires_grad_(True)
    out_all, _ = ref(x_all[None])
    (out_all[0].float() * torch.cat(gs).float()).sum().backward()
    lo, hi = t.expert_range(r)
    mine = slice(sum(Ns[:r]), sum(Ns[: r + 1]))
    res: dict[str, Any] = {"tokens": Ns[r], "out_scale": float(out_all.detach().abs().max())}

    FakeBuffer.instances.clear()
    block = _block(D, E, K, W, 0).bfloat16()
    moe = _moe(group, block)  # shares block's router
    x = xs[r].clone().requires_grad_(True)
    out, _ = moe(x[None])
    (out[0].float() * gs[r].float()).sum().backward()
    gate_grad = block.gate.weight.grad.float().clone()
    dist.all_reduce(gate_grad)
    le = moe.local_experts
    res["normal"] = {
        "out": _maxdiff(out[0].float(), out_all[0, mine].float()),
        "x_grad": _maxdiff(x.grad.float(), x_all.grad[mine].float()),
        "gate_grad": _maxdiff(gate_grad, ref.gate.weight.grad.float()),
        "gate_up_grad": _maxdiff(
            le.gate_up_proj.grad.float(), ref.experts.gate_up_proj.grad[lo:hi].float()
        ),  # fmt: skip
        "down_grad": _maxdiff(le.down_proj.grad.float(), ref.experts.down_proj.grad[lo:hi].float()),
        "grad_scale": float(x_all.grad.abs().max()),
        "meter": moe.dispatcher.meter.summary(),
        "buffers": [
            (b.num_nvl_bytes, b.num_rdma_bytes, b.low_latency_mode, b.num_qps_per_rank)
            for b in FakeBuffer.instances
        ],  # fmt: skip
        "calls": [c for b in FakeBuffer.instances for c in b.calls],
    }

    # float32 activations: bf16 on the wire, float32 back (forward against the fp32 reference)
    ref32 = _block(D, E, K, W, 0)
    x32 = _inputs(Ns, D, 0)[0]
    with torch.no_grad():
        want32 = ref32(torch.cat(x32)[None])[0][0, mine]
        got32 = _moe(group, _block(D, E, K, W, 0))(x32[r][None])[0][0]
    res["fp32"] = {"out": _maxdiff(got32, want32), "dtype": got32.dtype,
                   "out_scale": float(want32.abs().max()) if want32.numel() else 0.0}  # fmt: skip

    FakeBuffer.instances.clear()
    moe = _moe(group, _block(D, E, K, W, 0).bfloat16(), mode="low_latency",
               num_max_dispatch_tokens_per_rank=N)  # fmt: skip
    with torch.no_grad():
        out_ll, _ = moe(xs[r][None])
    res["low_latency"] = {
        "out": _maxdiff(out_ll[0].float(), out_all[0, mine].float()),
        "meter": moe.dispatcher.meter.summary(),
        "buffers": [
            (b.num_nvl_bytes, b.num_rdma_bytes, b.low_latency_mode, b.num_qps_per_rank)
            for b in FakeBuffer.instances
        ],  # fmt: skip
        "calls": [c for b in FakeBuffer.instances for c in b.calls],
    }
    return res
