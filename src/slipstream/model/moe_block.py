"""Mixture-of-experts FFN: softmax top-k router, stacked SwiGLU experts with interchangeable
compute paths, optional Qwen2-MoE shared expert, and the router losses.

Shape legend: N tokens (flattened B*T), D hidden_size, E experts, k experts per token, I expert
FFN width, A = N*k token-expert assignments, M the tokens a block computes when it skips padding.

Expert paths (`moe_impl`: config/model.py's `MOE_IMPLS`, set on a built model by
model/converters.py's `ExpertPath`), all numerically the same function:
- "grouped" (default): sort the A assignments by expert (one stable sort), expert offsets by a
  binary search of the sorted ids (on the device, static shapes), one `torch._grouped_mm` per
  projection, unsort with one index_copy and combine: ~30 aten ops per MoE layer forward and
  backward whatever E, and no host sync (no `.tolist()`, `nonzero` or `.item()`). Computes in
  the autocast dtype when autocast is on (bf16 on CUDA: `_grouped_mm`'s only CUDA dtype).
  Where `_grouped_mm` cannot run (rows not 16-byte aligned, fp32 on CUDA, a torch without it) it
  runs the per-expert segment loop instead (one host sync for the segment sizes, ~5 ops per
  expert), a fallback logged once and recorded in `fallbacks`.
- "grouped_mm": the same, but a case `_grouped_mm` cannot run is an error (no fallback).
- "loop": the reference per-expert loop with masks (as transformers), kept for tests/benchmarks.
Inside "grouped", not a choice of its own: under no-grad at small expert sizes (decode) it runs
two bmm over a zero-padded (E, C, D) buffer (`Experts._batched`; C = the largest expert's count:
one host sync).
The inference engine's decode path, not a config choice either: "static" (`STATIC_IMPL`,
`static_experts`; engine/decode.py's `static_moe` sets it around decode calls), the grouped_mm
path with the expert offsets counted on device: static shapes, no host sync, so a decode step can
be captured in a CUDA graph; falls back to "grouped" (logged once) where `torch._grouped_mm`
cannot run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from slipstream.config.model import MOE_IMPLS, ModelConfig
from slipstream.model.expert_activation import Activation, SwiGLU, expert_activation
from slipstream.model.layers import MLP, linear, shared_arange, shared_zeros, step_zeros
from slipstream.model.router import (
    Router,
    RoutingScheme,
    SigmoidGroupTopK,
    SoftmaxTopK,
    routing_scheme,
)

log = logging.getLogger(__name__)

STATIC_IMPL = "static"
"""The engine's decode path (see the module docstring): `Experts.forward` takes it besides
`MOE_IMPLS`; a block's configured path is always one of `MOE_IMPLS`."""
# "grouped" runs its batched sub-path (`Experts._batched`) under no-grad when every expert gets at least this many assignments
# on average (N * k >= BATCHED_MIN_PER_EXPERT * E) and one expert's gate_up_proj holds at most
# BATCHED_MAX_EXPERT_NUMEL elements. Measured on the 2-vCPU dev VM (1 thread, fp32; N = tokens):
# E=8, D=I=128 (gate_up 32K): batched 0.6-0.9x grouped's time from N=4 up (102 vs 126 us at N=1);
# E=16, D=I=256 (gate_up 131K): batched 1.1-7x slower at every N (weight reads dominate there and
# batched reads every expert's weights and pads).
BATCHED_MIN_PER_EXPERT = 1
BATCHED_MAX_EXPERT_NUMEL = 65536
_warned: set[str] = set()
fallbacks: list[str] = []
"""Fallbacks taken in this process (recorded so benchmarks/runs can report them)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local part (autograd flows back to the DTensor); a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def _fallback_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        fallbacks.append(msg)
        log.warning(msg)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: `_grouped_mm` rejects the
    stride-0 gradients that e.g. `.sum()` produces."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return g.contiguous()


def grouped_mm_unavailable(
    device: torch.device, dtype: torch.dtype, inner_sizes: Sequence[int]
) -> str | None:
    """None if torch._grouped_mm can run here, else the reason it cannot."""
    if not hasattr(torch, "_grouped_mm"):
        return "torch._grouped_mm is not available in this torch build"
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"torch._grouped_mm takes float32, bfloat16 or float16, got {dtype}"
    itemsize = dtype.itemsize  # (not an empty tensor's element_size: an op per MoE layer)
    if any((s * itemsize) % 16 for s in inner_sizes):
        return f"row sizes {list(inner_sizes)} x {itemsize} bytes not 16-byte aligned"
    if device.type == "cuda" and dtype != torch.bfloat16:
        return (
            f"torch._grouped_mm on CUDA needs bfloat16, got {dtype} (set trainer.precision = "
            "'bf16')"
        )
    return None


def _expert_offsets(sorted_ids_A: torch.Tensor, num_experts: int) -> torch.Tensor:
    """offs[e] = assignments to experts 0..e (the end of expert e's segment), int32, computed on
    the device by a binary search of the sorted ids (bincount on CUDA reads its max on the
    host)."""
    experts_E = shared_arange(num_experts, sorted_ids_A.device)
    return torch.searchsorted(sorted_ids_A, experts_E, right=True, out_int32=True)


class _GroupedExperts(torch.autograd.Function):
    """sum_j w[n, j] * SwiGLU_{ids[n, j]}(x[n]) through torch._grouped_mm, with a hand-written
    backward: ~16 aten ops forward and ~20 backward per MoE layer whatever E (autograd through
    the same forward: ~70), no host sync. Sort the N*k assignments by expert (stable), gather
    their rows, two grouped matmuls over the experts' segments (offsets by a binary search of
    the sorted ids, on the device), unsort, gate-weighted sum over k. Computes in `dtype`
    (weights and x cast to it, as autocast casts a Linear's); returns `dtype`. Saves the gathered
    rows, the gate/up activations and the unsorted expert outputs (what autograd would save; the
    SwiGLU product is recomputed in backward)."""

    @staticmethod
    def forward(ctx, x_ND, w_Nk, gate_up_w_E, down_w_E, ids_Nk, dtype, act, gate_up_b_E, down_b_E,  # type: ignore[override]
                static=None):  # fmt: skip
        """`static`: `Experts._static_weights` (the weights' transposed views and arange(E),
        made once, not per forward) when the weights are in `dtype` already."""
        N, k = ids_Nk.shape
        ids_A = ids_Nk.reshape(-1)
        sorted_ids_A, order_A = torch.sort(ids_A, stable=True)
        tok_A = order_A // k
        x_AD = x_ND.to(dtype).index_select(0, tok_A)
        gate_up_c, down_c = gate_up_w_E.to(dtype), down_w_E.to(dtype)
        if static is None:
            offs_E = _expert_offsets(sorted_ids_A, gate_up_w_E.shape[0])
            gate_up_t, down_t = gate_up_c.transpose(1, 2), down_c.transpose(1, 2)
        else:
            gate_up_t, down_t, experts_E = static
            offs_E = torch.searchsorted(sorted_ids_A, experts_E, right=True, out_int32=True)
        h_A2I = torch._grouped_mm(x_AD, gate_up_t, offs=offs_E)
        if gate_up_b_E is not None:  # per-assignment bias rows of its expert
            h_A2I = h_A2I + gate_up_b_E.to(dtype).index_select(0, sorted_ids_A)
        y_AD = torch._grouped_mm(act(h_A2I), down_t, offs=offs_E)
        # unsort: row order_A[a] of the (N*k) assignments is sorted row a (one out-of-place
        # index_copy, a permutation: every row written); a bias is added while unsorting
        # (index_add onto the bias rows in token order: b + y, the same sum as y + b)
        if down_b_E is None:
            y_AD = y_AD.index_copy(0, order_A, y_AD)
        else:
            y_AD = down_b_E.to(dtype).index_select(0, ids_A).index_add_(0, order_A, y_AD)
        y_NkD = y_AD.view(N, k, y_AD.shape[-1])
        w_Nk1 = w_Nk.to(dtype).unsqueeze(-1)
        ctx.save_for_backward(x_AD, h_A2I, y_NkD, w_Nk1, order_A, tok_A, offs_E, gate_up_c, down_c,
                              sorted_ids_A)  # fmt: skip
        ctx.dtypes = (x_ND.dtype, w_Nk.dtype, gate_up_w_E.dtype, down_w_E.dtype)
        ctx.act = act
        ctx.bias_dtypes = (
            None if gate_up_b_E is None else gate_up_b_E.dtype,
            None if down_b_E is None else down_b_E.dtype,
        )
        return (y_NkD * w_Nk1).sum(dim=1)  # combine_topk

    @staticmethod
    def backward(ctx, g_ND):  # type: ignore[override]
        (x_AD, h_A2I, y_NkD, w_Nk1, order_A, tok_A, offs_E, gate_up_c, down_c,
         sorted_ids_A) = ctx.saved_tensors  # fmt: skip
        x_dtype, w_dtype, gate_up_dtype, down_dtype = ctx.dtypes
        N, k, D = y_NkD.shape
        E = gate_up_c.shape[0]
        g_N1D = g_ND.to(y_NkD.dtype).unsqueeze(1)
        g_w = (y_NkD * g_N1D).sum(-1).to(w_dtype) if ctx.needs_input_grad[1] else None
        # gradient of each assignment's expert output, in sorted order
        g_y_AD = (g_N1D * w_Nk1).view(N * k, D).index_select(0, order_A)
        g_act_AI = torch._grouped_mm(g_y_AD, down_c, offs=offs_E)
        g_h_A2I, act_AI = ctx.act.backward(g_act_AI, h_A2I)
        g_down = None
        if ctx.needs_input_grad[3]:  # per expert: g_y^T @ act, (E, D, I)
            g_down = torch._grouped_mm(g_y_AD.t(), act_AI, offs=offs_E).to(down_dtype)
        g_gate_up = None
        if ctx.needs_input_grad[2]:  # per expert: g_h^T @ x, (E, 2I, D)
            g_gate_up = torch._grouped_mm(g_h_A2I.t(), x_AD, offs=offs_E).to(gate_up_dtype)
        g_x = None
        if ctx.needs_input_grad[0]:
            g_x_AD = torch._grouped_mm(g_h_A2I, gate_up_c, offs=offs_E)
            # out of place onto the step's shared zeros: one op (new_zeros + index_add_: two)
            g_x = torch.index_add(step_zeros(N, (D,), g_x_AD), 0, tok_A, g_x_AD).to(x_dtype)
        gate_up_b_dtype, down_b_dtype = ctx.bias_dtypes
        g_gate_up_b = g_down_b = None
        if ctx.needs_input_grad[7]:  # out-of-place onto shared zeros: one op, not two
            g_gate_up_b = torch.index_add(shared_zeros((E, g_h_A2I.shape[1]), g_h_A2I), 0,
                                          sorted_ids_A, g_h_A2I).to(gate_up_b_dtype)  # fmt: skip
        if ctx.needs_input_grad[8]:
            g_down_b = torch.index_add(shared_zeros((E, D), g_y_AD), 0, sorted_ids_A,
                                       g_y_AD).to(down_b_dtype)  # fmt: skip
        return g_x, g_w, g_gate_up, g_down, None, None, None, g_gate_up_b, g_down_b, None


def _segment_loop_swiglu(
    x_AD: torch.Tensor,
    sorted_ids_A: torch.Tensor,
    gate_up_w_E: torch.Tensor,
    down_w_E: torch.Tensor,
    dtype: torch.dtype,
    act: Activation,
    gate_up_b_E: torch.Tensor | None,
    down_b_E: torch.Tensor | None,
) -> torch.Tensor:
    """`_grouped_swiglu` as one matmul per non-empty expert segment (the fallback): reads the
    segment sizes on the host."""
    num_experts = gate_up_w_E.shape[0]
    counts = torch.bincount(sorted_ids_A, minlength=num_experts).tolist()
    # unbind once: indexing W[e] per expert would make backward allocate and add a full
    # (E, ...) gradient per expert (O(E^2) traffic); unbind's backward is one stack.
    gate_up_w, down_w = gate_up_w_E.to(dtype).unbind(0), down_w_E.to(dtype).unbind(0)
    # split (backward: one cat), not per-segment slicing (backward: a full-size zero
    # gradient per expert)
    outs = []
    gate_up_b = down_b = None
    if gate_up_b_E is not None and down_b_E is not None:
        gate_up_b, down_b = gate_up_b_E.to(dtype).unbind(0), down_b_E.to(dtype).unbind(0)
    for e, seg in enumerate(x_AD.to(dtype).split(counts)):
        if seg.shape[0] == 0:
            continue
        if gate_up_b is not None and down_b is not None:
            outs.append(F.linear(act(F.linear(seg, gate_up_w[e], gate_up_b[e])), down_w[e],
                                 down_b[e]))  # fmt: skip
        else:
            outs.append(F.linear(act(F.linear(seg, gate_up_w[e])), down_w[e]))
    return torch.cat(outs) if outs else x_AD.new_zeros(x_AD.shape, dtype=dtype)


def combine_topk(w_Nk: torch.Tensor, y_NkD: torch.Tensor) -> torch.Tensor:
    """sum_j w[n, j] * y[n, j, :]: the gate-weighted sum of each token's k expert outputs (the
    combine of every expert path and EP dispatcher). Elementwise multiply + sum over k: the
    batched (1 x k) @ (k x D) product it replaces cost ~1 ms more per MoE layer fwd+bwd at the
    quickstart's shapes (N = 704, k = 2, D = 128; best of 6 rounds, 1 thread, this dev VM)."""
    return (y_NkD * w_Nk.to(y_NkD.dtype).unsqueeze(-1)).sum(dim=1)


class Experts(nn.Module):
    """E gated experts stored stacked, in transformers-5 layout: gate_up_proj (E, 2I, D) with the
    gate rows first, down_proj (E, D, I). Weights are applied as x @ W^T (nn.Linear convention).
    `activation` (model/expert_activation.py; SwiGLU by default); `bias`: gate_up_proj_bias
    (E, 2I), gate first, and down_proj_bias (E, D) (GPT-OSS), added after each projection in
    every path."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        activation: Activation | None = None,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.activation: Activation = activation or SwiGLU()
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.gate_up_proj_bias: nn.Parameter | None = None
        self.down_proj_bias: nn.Parameter | None = None
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.zeros(num_experts, 2 * intermediate_size))
            self.down_proj_bias = nn.Parameter(torch.zeros(num_experts, hidden_size))

    def biases(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(gate_up_proj_bias, down_proj_bias) as plain local tensors (see `weights`), or Nones."""
        if self.gate_up_proj_bias is None or self.down_proj_bias is None:
            return None, None
        return _local(self.gate_up_proj_bias), _local(self.down_proj_bias)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up_proj, down_proj) as the plain tensors this process computes with: a DTensor
        parameter (FSDP2-sharded, placed on an expert-parallel mesh) gives its local part, which
        FSDP has unsharded to this rank's experts for the forward."""
        return _local(self.gate_up_proj), _local(self.down_proj)

    def _static_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate_up_proj^T (E, D, 2I), down_proj^T (E, I, D), arange(E)) for `static_experts`
        and `_GroupedExperts`:
        views made once, not per forward (decode is per-op overhead bound), remade when a
        parameter's storage moves (`.to`, a new Parameter). Views of the storage, so in-place
        weight updates show through."""
        gate_up_w_E, down_w_E = self.weights()
        key = (gate_up_w_E.data_ptr(), down_w_E.data_ptr(), gate_up_w_E.device)
        cached = self.__dict__.get("_static")
        if cached is None or cached[0] != key:
            # outside inference mode and autograd: the training forward uses them too
            with torch.inference_mode(False), torch.no_grad():
                experts_E = shared_arange(gate_up_w_E.shape[0], gate_up_w_E.device)
                views = (gate_up_w_E.transpose(1, 2), down_w_E.transpose(1, 2), experts_E)
            cached = (key, views)
            self.__dict__["_static"] = cached
        return cached[1]

    def forward(
        self,
        x_ND: torch.Tensor,
        ids_Nk: torch.Tensor,
        w_Nk: torch.Tensor,
        impl: str = "grouped",
        keepdim: bool = False,
    ) -> torch.Tensor:
        """sum_j w[n, j] * expert_{ids[n, j]}(x[n]) for every token n (ids index this module's
        experts): (N, D), or with `keepdim` (N, 1, D) (on the static path without a view op)."""
        if keepdim and impl != STATIC_IMPL:
            return self(x_ND, ids_Nk, w_Nk, impl)[:, None]
        gate_up_w_E, down_w_E = self.weights()
        gate_up_b_E, down_b_E = self.biases()
        act = self.activation
        num_experts = gate_up_w_E.shape[0]
        if impl == STATIC_IMPL:
            reason = grouped_mm_unavailable(
                x_ND.device, x_ND.dtype, (x_ND.shape[1], self.intermediate_size)
            )
            if reason is None:
                return static_experts(x_ND, ids_Nk, w_Nk, *self._static_weights(), act=act,
                                      gate_up_b_E=gate_up_b_E, down_b_E=down_b_E,
                                      keepdim=keepdim)  # fmt: skip
            _fallback_once(f"static:{reason}", f"moe_impl='static' -> 'grouped': {reason}")
            return self(x_ND, ids_Nk, w_Nk, "grouped", keepdim)
        if impl == "loop":
            return self._loop(x_ND, ids_Nk, w_Nk, gate_up_w_E, down_w_E, act, gate_up_b_E,
                              down_b_E)  # fmt: skip
        if impl not in MOE_IMPLS:
            raise ValueError(f"moe_impl={impl!r}; expected one of {MOE_IMPLS} (or {STATIC_IMPL!r})")
        N, k = ids_Nk.shape
        if (
            impl == "grouped"
            and not torch.is_grad_enabled()
            and N * k >= BATCHED_MIN_PER_EXPERT * num_experts
            and gate_up_w_E[0].numel() <= BATCHED_MAX_EXPERT_NUMEL
        ):
            return self._batched(x_ND, ids_Nk, w_Nk, gate_up_w_E, down_w_E, act, gate_up_b_E,
                                 down_b_E)  # fmt: skip
        # compute dtype: autocast's when on (the experts are matmuls, which autocast would cast)
        dtype = x_ND.dtype
        if torch.is_autocast_enabled(x_ND.device.type):
            dtype = torch.get_autocast_dtype(x_ND.device.type)
        reason = grouped_mm_unavailable(x_ND.device, dtype, (x_ND.shape[1], self.intermediate_size))
        if reason is not None and impl == "grouped_mm":
            raise RuntimeError(
                f"moe_impl='grouped_mm' cannot run here: {reason} (moe_impl='grouped' falls back "
                "to a per-expert loop)"
            )
        if reason is None:
            # the cached transposes when no cast is due; not for a DTensor (FSDP2 frees and
            # re-gathers its storage between forwards)
            same = gate_up_w_E.dtype == dtype == down_w_E.dtype and not isinstance(
                self.gate_up_proj, DTensor
            )
            return _GroupedExperts.apply(x_ND, w_Nk, gate_up_w_E, down_w_E, ids_Nk, dtype, act,
                                         gate_up_b_E, down_b_E,
                                         self._static_weights() if same else None)  # fmt: skip
        _fallback_once(reason, f"moe_impl='grouped': per-expert loop: {reason}")
        sorted_ids_A, order_A = torch.sort(ids_Nk.reshape(-1), stable=True)
        x_AD = x_ND.index_select(0, order_A // k)
        y_AD = _segment_loop_swiglu(x_AD, sorted_ids_A, gate_up_w_E, down_w_E, dtype, act,
                                    gate_up_b_E, down_b_E)  # fmt: skip
        # unsort: row order_A[a] of the (N*k) assignments is sorted row a
        y_NkD = y_AD.new_empty(y_AD.shape).index_copy(0, order_A, y_AD).view(N, k, y_AD.shape[-1])
        return combine_topk(w_Nk, y_NkD).to(x_ND.dtype)

    @staticmethod
    def _batched(
        x_ND: torch.Tensor,
        ids_Nk: torch.Tensor,
        w_Nk: torch.Tensor,
        gate_up_w_E: torch.Tensor,
        down_w_E: torch.Tensor,
        act: Activation,
        gate_up_b_E: torch.Tensor | None,
        down_b_E: torch.Tensor | None,
    ) -> torch.Tensor:
        """All experts in two batched matmuls over a zero-padded (E, C, D) buffer, C = the largest
        expert's assignment count: a fixed ~20 ops whatever E (grouped: ~5 per expert), at the cost
        of reading every expert's weights and computing the padding. Wins where per-op overhead
        dominates (small experts, few tokens per expert)."""
        N, k = ids_Nk.shape
        D = x_ND.shape[1]
        flat_ids_A = ids_Nk.reshape(-1)
        order_A = torch.argsort(flat_ids_A, stable=True)
        sorted_ids_A = flat_ids_A.index_select(0, order_A)
        num_experts = gate_up_w_E.shape[0]
        counts_E = torch.bincount(flat_ids_A, minlength=num_experts)
        starts_E = counts_E.cumsum(0) - counts_E
        # slot of each sorted assignment within its expert's segment
        slot_A = torch.arange(order_A.numel(), device=x_ND.device) - starts_E[sorted_ids_A]
        capacity = int(counts_E.max())
        x_ECD = x_ND.new_zeros(num_experts, capacity, D)
        x_ECD[sorted_ids_A, slot_A] = x_ND.index_select(0, order_A // k)
        h_EC2I = torch.bmm(x_ECD, gate_up_w_E.transpose(1, 2))
        if gate_up_b_E is not None:
            h_EC2I = h_EC2I + gate_up_b_E[:, None]
        y_ECD = torch.bmm(act(h_EC2I), down_w_E.transpose(1, 2))
        if down_b_E is not None:
            y_ECD = y_ECD + down_b_E[:, None]
        y_AD = torch.empty(order_A.numel(), D, dtype=y_ECD.dtype, device=y_ECD.device)
        y_AD[order_A] = y_ECD[sorted_ids_A, slot_A]
        return combine_topk(w_Nk, y_AD.view(N, k, D))

    @staticmethod
    def _loop(
        x_ND: torch.Tensor,
        ids_Nk: torch.Tensor,
        w_Nk: torch.Tensor,
        gate_up_w_E: torch.Tensor,
        down_w_E: torch.Tensor,
        act: Activation,
        gate_up_b_E: torch.Tensor | None,
        down_b_E: torch.Tensor | None,
    ) -> torch.Tensor:
        out_ND = torch.zeros_like(x_ND)
        for e in range(gate_up_w_E.shape[0]):
            tok_idx, slot = torch.where(ids_Nk == e)
            if tok_idx.numel() == 0:
                continue
            h = F.linear(
                x_ND[tok_idx], gate_up_w_E[e], None if gate_up_b_E is None else gate_up_b_E[e]
            )
            y = F.linear(act(h), down_w_E[e], None if down_b_E is None else down_b_E[e])
            y = y * w_Nk[tok_idx, slot, None]
            out_ND.index_add_(0, tok_idx, y.to(out_ND.dtype))
        return out_ND


def static_experts(
    x_ND: torch.Tensor,
    ids_Nk: torch.Tensor,
    w_Nk: torch.Tensor,
    gate_up_w_EDI: torch.Tensor,
    down_w_EID: torch.Tensor,
    experts_E: torch.Tensor,
    act: Activation | None = None,
    gate_up_b_E: torch.Tensor | None = None,
    down_b_E: torch.Tensor | None = None,
    keepdim: bool = False,
) -> torch.Tensor:
    """The experts for inference with static shapes and no host sync: assignments sorted by
    expert, one `torch._grouped_mm` per projection over device-side offsets (searchsorted over
    the sorted ids), unsorted with one index_copy. Weights come transposed ((E, D, 2I), (E, I, D)) with `experts_E` = arange(E)
    (`Experts._static_weights`). ~20 ops whatever E, capturable in a CUDA graph. The same function as the other
    paths (tests/unit/test_engine_ops.py). On CPU `_grouped_mm` measured as fast as "grouped" or
    faster (1 thread: E=32 top-4 D=1024 I=512 N=64: 23.9 vs 25.3 ms; E=8 top-2 D=I=128 N=64: 245
    vs 308 us). Caller checks `grouped_mm_unavailable` (Experts.forward with impl "static").
    `keepdim`: (N, 1, D) out (a decode step's (B, 1, D) with no view op), else (N, D)."""
    N, k = ids_Nk.shape
    ids_A = ids_Nk.reshape(-1)
    sorted_ids_A, order_A = ids_A.sort(stable=True)
    x_AD = x_ND.index_select(0, order_A // k)
    # offs_E[e] = end of expert e's segment; bincount would read its maximum on the host on CUDA
    offs_E = torch.searchsorted(sorted_ids_A, experts_E, right=True, out_int32=True)
    h_A2I = torch._grouped_mm(x_AD, gate_up_w_EDI, offs=offs_E)
    if gate_up_b_E is not None:
        h_A2I = h_A2I + gate_up_b_E.index_select(0, sorted_ids_A)
    if act is None:
        gate, up = h_A2I.chunk(2, dim=-1)
        act_AI = F.silu(gate) * up
    else:
        act_AI = act(h_A2I)
    y_AD = torch._grouped_mm(act_AI, down_w_EID, offs=offs_E)
    # unsort (a permutation: all rows)
    if down_b_E is None:
        y_AD = y_AD.index_copy(0, order_A, y_AD)
    else:  # added while unsorting: each row gets its expert's bias plus its output, the same
        # sum as y + b (one add per element: exact), one op fewer than add + index_copy
        y_AD = down_b_E.index_select(0, ids_A).index_add_(0, order_A, y_AD)
    y_NkD = y_AD.view(N, k, -1)
    w_Nk = w_Nk if w_Nk.dtype == y_NkD.dtype else w_Nk.to(y_NkD.dtype)
    return (y_NkD * w_Nk[:, :, None]).sum(dim=1, keepdim=keepdim)  # combine_topk, no no-op cast


class SparseMoeBlock(nn.Module):
    """Router `gate` (model/router.py `Router`: Linear D->E, optional bias and correction bias)
    + `experts`; optional shared expert: `shared_expert` scaled by sigmoid(`shared_expert_gate`(x))
    as in Qwen2-MoE, or (`shared_expert_gated=False`) `shared_experts` added as it is (GLM-4.5 /
    DeepSeek). Routing: the `scheme` (model/router.py; default: softmax in float32 over all E
    logits, top-k, optional renormalisation, `norm_topk_prob`)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        norm_topk_prob: bool,
        shared_expert_intermediate_size: int = 0,
        impl: str = "grouped",
        *,
        scheme: RoutingScheme | None = None,
        router_bias: bool = False,
        correction_bias: bool = False,
        shared_expert_gated: bool = True,
        activation: Activation | None = None,
        expert_bias: bool = False,
    ) -> None:
        """`impl`: the expert path (one of `MOE_IMPLS`); a model's blocks start on "grouped" and
        model/converters.py's `ExpertPath` sets the configured one."""
        super().__init__()
        if top_k > num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} > num_experts={num_experts}")
        if impl not in MOE_IMPLS:
            raise ValueError(f"moe_impl={impl!r}; expected one of {MOE_IMPLS}")
        self.top_k, self.norm_topk_prob, self.impl = top_k, norm_topk_prob, impl
        self.scheme: RoutingScheme = scheme or SoftmaxTopK(top_k, norm_topk_prob)
        self.gate = Router(
            hidden_size,
            num_experts,
            bias=router_bias,
            correction_bias=correction_bias,
            fp32=isinstance(self.scheme, SigmoidGroupTopK),
        )
        self.experts = Experts(num_experts, hidden_size, intermediate_size, activation, expert_bias)
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        self.shared_experts: MLP | None = None
        self.routing_sink: Callable[[torch.Tensor], None] | None = None
        """Set by an inference engine to record routing: called with the top-k expert ids (N, k)
        of every forward (read-only; the forward's numerics do not change)."""
        if shared_expert_intermediate_size > 0 and shared_expert_gated:
            self.shared_expert = MLP(hidden_size, shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        elif shared_expert_intermediate_size > 0:
            self.shared_experts = MLP(hidden_size, shared_expert_intermediate_size)

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> SparseMoeBlock:
        """The block a model of `cfg` builds for its MoE layers (on the default expert path)."""
        return cls(
            cfg.hidden_size,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.moe_intermediate_size,
            cfg.norm_topk_prob,
            cfg.shared_expert_intermediate_size,
            scheme=routing_scheme(cfg),
            router_bias=cfg.router_bias,
            correction_bias=cfg.router_correction_bias,
            shared_expert_gated=cfg.shared_expert_gated,
            activation=expert_activation(cfg),
            expert_bias=cfg.expert_bias,
        )

    def route(
        self, x_ND: torch.Tensor, replay_ids_Nk: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (router logits (N, E) (float32 for an fp32 router, else x's dtype), top-k weights
        (N, k) in the logits' dtype, ids (N, k)).

        `replay_ids_Nk` (routing replay, R3): use these experts instead of the router's top-k;
        their weights are the scheme's weights from the live router's logits at those ids
        (model/router.py), so the router still gets its gradient and the correction bias (used
        for selection only) plays no part. With the ids the router itself would pick, the result
        equals the plain routing."""
        logits_NE = self.gate(x_ND)
        if replay_ids_Nk is not None:
            if replay_ids_Nk.shape != (x_ND.shape[0], self.top_k):
                raise ValueError(
                    f"replayed routing has shape {tuple(replay_ids_Nk.shape)}, the block routes "
                    f"{x_ND.shape[0]} tokens to top-{self.top_k}"
                )
            replay_ids_Nk = replay_ids_Nk.to(device=logits_NE.device, dtype=torch.long)
        w_Nk, ids_Nk = self.scheme.route(
            logits_NE, self.gate.e_score_correction_bias, replay_ids_Nk
        )
        if w_Nk.dtype != logits_NE.dtype:  # no no-op cast (decode is per-op overhead bound)
            w_Nk = w_Nk.to(logits_NE.dtype)
        return logits_NE, w_Nk, ids_Nk

    def forward(
        self, x_D: torch.Tensor, replay_ids_Nk: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (..., D) -> (output of x's shape, router logits (N, E)), N = the tokens in x
        (row-major; (B, T, D) or the model's packed (M, D)). `replay_ids_Nk`: see `route`."""
        if x_D.dim() == 2:  # already (N, D): no view ops (each one is dispatched, and again in
            return self._tokens(x_D, replay_ids_Nk)  # backward)
        x_ND = x_D.reshape(-1, x_D.shape[-1])
        if x_D.dim() == 3 and x_D.shape[1] == 1:  # (B, 1, D), decode: the experts' output
            return self._tokens(x_ND, replay_ids_Nk, x_D)  # comes in this shape (no view op)
        out_ND, logits_NE = self._tokens(x_ND, replay_ids_Nk)
        return out_ND.view_as(x_D), logits_NE

    def _tokens(
        self,
        x_ND: torch.Tensor,
        replay_ids_Nk: torch.Tensor | None,
        x_N1D: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, router logits (N, E)); `x_N1D`: x_ND's (N, 1, D) view, given to get the output
        in that shape."""
        logits_NE, w_Nk, ids_Nk = self.route(x_ND, replay_ids_Nk)
        if self.routing_sink is not None:
            self.routing_sink(ids_Nk)
        if x_N1D is not None and isinstance(self.experts, Experts):
            out_ND = self.experts(x_ND, ids_Nk, w_Nk, impl=self.impl, keepdim=True)
        else:  # an expert-parallel layer (moe/layer.py) takes no keepdim
            out_ND = self.experts(x_ND, ids_Nk, w_Nk, impl=self.impl)
            if x_N1D is not None:
                out_ND = out_ND.view_as(x_N1D)
        if out_ND.dtype != x_ND.dtype:
            out_ND = out_ND.to(x_ND.dtype)
        x_sh = x_ND if x_N1D is None else x_N1D  # the shared expert's input, out's shape
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            # `linear`: with autograd fewer ops than the nn.Linear's F.linear
            gate_N1 = torch.sigmoid(linear(x_sh, self.shared_expert_gate.weight))
            out_ND = out_ND + gate_N1 * self.shared_expert(x_sh)
        elif self.shared_experts is not None:
            out_ND = out_ND + self.shared_experts(x_sh)
        return out_ND, logits_NE


def router_losses(
    router_logits: Sequence[torch.Tensor],
    num_experts: int,
    top_k: int,
    token_mask_N: torch.Tensor | None = None,
    sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`load_balancing_loss`, `router_z_loss`) of the same logits, the layers' logits
    concatenated and the mask repeated once for both (the model's forward takes both)."""
    logits_LNE, m_LN = _concat(router_logits, token_mask_N)
    return (
        _load_balance(logits_LNE, m_LN, num_experts, top_k, sum_over_ranks),
        _z_loss(logits_LNE, m_LN, sum_over_ranks),
    )


def _concat(
    router_logits: Sequence[torch.Tensor], token_mask_N: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the layers' logits (L*N, E) float32, the mask repeated per layer (L*N,) float or None)."""
    logits_LNE = torch.cat([g.float() for g in router_logits], dim=0)
    if token_mask_N is None:
        return logits_LNE, None
    return logits_LNE, token_mask_N.reshape(-1).float().repeat(len(router_logits))


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor],
    num_experts: int,
    top_k: int,
    token_mask_N: torch.Tensor | None = None,
    sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Switch-Transformer load-balancing loss exactly as transformers computes it: logits of all
    MoE layers are concatenated (each (N, E)), then
    E * sum_{j,e} frac_tokens[j, e] * mean_prob[e], where frac_tokens[j, e] is the fraction of
    tokens whose j-th choice is e. Perfectly uniform routing gives top_k. `token_mask_N` (bool or
    0/1, the same N for every layer) excludes padding. Unweighted (no coefficient).

    `sum_over_ranks` (data-parallel training): adds the token counts and probability sums of every
    rank before the fractions are taken, so each rank computes the loss of the whole batch (its
    gradient then flows into this rank's tokens only; see parallel/ranks.py)."""
    logits_LNE, m_LN = _concat(router_logits, token_mask_N)
    return _load_balance(logits_LNE, m_LN, num_experts, top_k, sum_over_ranks)


def _load_balance(
    logits_LNE: torch.Tensor,
    m_LN: torch.Tensor | None,
    num_experts: int,
    top_k: int,
    sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None,
) -> torch.Tensor:
    probs = F.softmax(logits_LNE, dim=-1)
    _, ids = torch.topk(probs, top_k, dim=-1)
    # per (choice j, expert e): the (masked) tokens whose j-th choice is e, by one scatter-add
    # (F.one_hot checks its input's range on the host, and its (LN, k, E) product is larger)
    LN = probs.shape[0]
    m = torch.ones(LN, device=probs.device) if m_LN is None else m_LN
    frac_sum_kE = probs.new_zeros(top_k, num_experts).scatter_add_(
        1, ids.t(), m[None].expand(top_k, LN)
    )
    if m_LN is None and sum_over_ranks is None:
        frac_kE = frac_sum_kE / LN
        prob_E = probs.mean(dim=0)
    else:
        prob_sum_E = (probs * m[:, None]).sum(0)
        count = m.sum()
        if sum_over_ranks is not None:
            frac_sum_kE, prob_sum_E, count = _sum_all(
                sum_over_ranks, frac_sum_kE, prob_sum_E, count
            )
        denom = count.clamp_min(1.0)
        frac_kE = frac_sum_kE / denom
        prob_E = prob_sum_E / denom
    return (frac_kE * prob_E[None]).sum() * num_experts


def router_z_loss(
    router_logits: Sequence[torch.Tensor],
    token_mask_N: torch.Tensor | None = None,
    sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """ST-MoE router z-loss: mean over tokens (and MoE layers) of logsumexp(logits)^2.
    Unweighted. `sum_over_ranks`: as in `load_balancing_loss` (the whole batch's mean)."""
    logits_LNE, m_LN = _concat(router_logits, token_mask_N)
    return _z_loss(logits_LNE, m_LN, sum_over_ranks)


def _z_loss(
    logits_LNE: torch.Tensor,
    m_LN: torch.Tensor | None,
    sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None,
) -> torch.Tensor:
    z2 = torch.logsumexp(logits_LNE, dim=-1).pow(2)
    if m_LN is None and sum_over_ranks is None:
        return z2.mean()
    m = torch.ones_like(z2) if m_LN is None else m_LN
    total, count = (z2 * m).sum(), m.sum()
    if sum_over_ranks is not None:
        total, count = _sum_all(sum_over_ranks, total, count)
    return total / count.clamp_min(1.0)


def _sum_all(
    sum_over_ranks: Callable[[torch.Tensor], torch.Tensor], *ts: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """One reduction for several tensors (flattened, summed, split again)."""
    flat = sum_over_ranks(torch.cat([t.reshape(-1) for t in ts]))
    out, at = [], 0
    for t in ts:
        out.append(flat[at : at + t.numel()].view_as(t))
        at += t.numel()
    return tuple(out)
