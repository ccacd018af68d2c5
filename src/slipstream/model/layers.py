"""Dense building blocks of the Qwen3 decoder: RMSNorm, rotary embeddings, grouped-query
attention with per-head q/k RMSNorm, and the SwiGLU MLP. Numerics follow transformers'
Qwen3-MoE (norm in float32, RoPE tables in float32 cast to the activation dtype).

Shape legend: B batch, T tokens, D model width (hidden_size), H query heads, K key/value heads,
Dh head width, I FFN width, M real (non-padding) tokens of a packed batch, N = B*T.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.config.model import YarnRope
from slipstream.model import rope
from slipstream.model.attention import KVCache, causal_attend
from slipstream.model.attention_variants import variant_attend


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back before the weight (as HF), or with
    `weight_in_float32` the weight multiplied in float32 before the cast (GPT-OSS's norm; the
    same in float32)."""

    def __init__(self, dim: int, eps: float = 1e-6, weight_in_float32: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.weight_in_float32 = weight_in_float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_in_float32 and x.dtype != torch.float32:
            return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)
        if x.dtype == torch.float32 == self.weight.dtype and not torch.is_grad_enabled():
            # Inference in float32: one op with the weight folded in (bitwise equal to the line
            # below; decode is per-op overhead bound). Training keeps the HF form's backward.
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)), normalised in float32 and cast back to x's dtype before the weight
    (as HF); `weight` broadcasts over x's leading dims ((Dh,) or per head (heads, Dh)). With
    autograd: `_RMSNormFn`, whose backward is 8 ops (autograd through the decomposed norm: ~20 on
    CPU); forward bitwise equal to F.rms_norm's."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNormFn.apply(x, weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def clamp(x: torch.Tensor, bound: float) -> torch.Tensor:
    """x.clamp(-bound, bound); with autograd a Function whose backward is one op (autograd's
    clamp backward: 5), the same gradient: passed where x lies within the bounds, inclusive."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _ClampFn.apply(x, bound)
    return x.clamp(-bound, bound)


class _ClampFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, bound: float) -> torch.Tensor:  # type: ignore[override]
        y = x.clamp(-bound, bound)
        ctx.save_for_backward(y == x)  # bool: where the gradient passes
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        (inside,) = ctx.saved_tensors
        return g * inside, None


class _RMSNormFn(torch.autograd.Function):
    """y = w * xhat.to(dtype), xhat = x * r, r = rsqrt(mean(x^2) + eps) (float32); backward
    dx = r * (gxhat - xhat * mean(gxhat * xhat)), gxhat = g * w; dw = sum of g * xhat over the
    dims w broadcasts over."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        # aten's rms_norm kernel returning rstd too (CUDA: one fused kernel; CPU: its
        # decomposition, bitwise equal to F.rms_norm)
        xhat, rstd = torch.ops.aten._fused_rms_norm(x.float(), [x.shape[-1]], None, eps)
        xhat_c = xhat.to(x.dtype)
        ctx.save_for_backward(xhat, rstd, weight)
        ctx.x_dtype = x.dtype
        return weight * xhat_c

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        xhat, rstd, weight = ctx.saved_tensors
        gw = None
        if ctx.needs_input_grad[1]:
            lead = g.dim() - weight.dim()
            gw = (g * xhat.to(ctx.x_dtype)).sum(dim=tuple(range(lead))).to(weight.dtype)
        gx = None
        if ctx.needs_input_grad[0]:
            gx = _rms_norm_grad_x(g, xhat, rstd, weight, ctx.x_dtype)
        return gx, gw, None


def _rms_norm_grad_x(
    g: torch.Tensor, xhat: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor, x_dtype
) -> torch.Tensor:
    """dx = r * (gxhat - xhat * mean(gxhat * xhat)), gxhat = g * w (`_RMSNormFn`'s)."""
    gxhat = (g * weight).float()
    mean_N1 = (gxhat * xhat).mean(-1, keepdim=True)
    return (rstd * torch.addcmul(gxhat, xhat, mean_N1, value=-1.0)).to(x_dtype)


def rms_norm_qk(
    qk: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    num_q_heads: int,
    eps: float,
    one: bool = False,
) -> torch.Tensor:
    """Per-head RMSNorm of q and k heads together, qk (..., H + K, Dh) or one token's
    (..., H + K, 1, Dh): the first H heads normed with the weight wq (Dh,), the rest with wk.
    As `rms_norm` with their (H + K, Dh) table (the same values), but with autograd one
    Function whose backward sums each weight's gradient over its heads directly (2 ops fewer
    than autograd's through the table's cat and expands; the same gradient up to rounding)."""
    if torch.is_grad_enabled() and (qk.requires_grad or wq.requires_grad or wk.requires_grad):
        return _QKRMSNormFn.apply(qk, wq, wk, num_q_heads, eps, one)
    return rms_norm(qk, _qk_table(qk, wq, wk, num_q_heads, one), eps)


def _qk_table(
    qk: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, H: int, one: bool
) -> torch.Tensor:
    """The (H + K, Dh) weight table of qk's heads, or with `one` (H + K, 1, Dh)."""
    C, Dh = qk.shape[-3 if one else -2], qk.shape[-1]
    table = torch.cat((wq.expand(H, Dh), wk.expand(C - H, Dh)))
    return table.view(C, 1, Dh) if one else table


def _qk_norm_forward(
    qk: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, H: int, eps: float, one: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-head q/k norm's forward for the Functions below: (out, xhat, rstd, table)."""
    table = _qk_table(qk, wq, wk, H, one)
    xhat, rstd = torch.ops.aten._fused_rms_norm(qk.float(), [qk.shape[-1]], None, eps)
    return table * xhat.to(qk.dtype), xhat, rstd, table


def _qk_norm_weight_grads(
    g: torch.Tensor, xhat: torch.Tensor, table: torch.Tensor, H: int, x_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dwq, dwk): g * xhat summed over the q heads, over the k heads (and every other dim but
    the last); the heads' dim lines up with the table's first: (C, Dh) or (C, 1, Dh)."""
    prod = g * xhat.to(x_dtype)
    gq, gk = prod.split((H, table.shape[0] - H), dim=-table.dim())
    dims = tuple(range(prod.dim() - 1))
    return gq.sum(dims).to(table.dtype), gk.sum(dims).to(table.dtype)


class _QKRMSNormFn(torch.autograd.Function):
    """`rms_norm_qk` with autograd: `_RMSNormFn` with the weight table made inside (no autograd
    graph for its cat and expands); dwq, dwk = g * xhat summed over the q heads, the k heads."""

    @staticmethod
    def forward(ctx, qk, wq, wk, H, eps, one):  # type: ignore[override]
        out, xhat, rstd, table = _qk_norm_forward(qk, wq, wk, H, eps, one)
        ctx.save_for_backward(xhat, rstd, table)
        ctx.x_dtype, ctx.H = qk.dtype, H
        return out

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        xhat, rstd, table = ctx.saved_tensors
        gwq = gwk = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            gwq, gwk = _qk_norm_weight_grads(g, xhat, table, ctx.H, ctx.x_dtype)
        gx = None
        if ctx.needs_input_grad[0]:
            gx = _rms_norm_grad_x(g, xhat, rstd, table, ctx.x_dtype)
        return gx, gwq, gwk, None, None, None


def qk_norm_rope_packed(
    qkv_MCD: torch.Tensor,
    num_q_heads: int,
    rotary_dim: int,
    cos_M1r: torch.Tensor,
    sin_signed_M1r: torch.Tensor,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None,
) -> torch.Tensor:
    """The packed training path's q/k heads made ready for attention in one Function: qkv
    (M, H + 2K, Dh) -> the same layout with the q and k heads normed per head (`norm`: their
    weights and eps; None: no norm) and rotated over their first `rotary_dim` dims
    (`packed_rope_tables`' tables), the v heads as they are (cast to the norm's dtype, as
    `torch.cat` with the normed heads would). The same values as the norm, split, rotation and
    cats it replaces; their backward by hand: 3 ops fewer per layer than autograd's slices and
    cats (the trainer step is per-op overhead bound on a GPU)."""
    if norm is None:
        return _QKNormRopeFn.apply(qkv_MCD, None, None, num_q_heads, rotary_dim, cos_M1r,
                                   sin_signed_M1r, 0.0)  # fmt: skip
    wq, wk, eps = norm
    return _QKNormRopeFn.apply(qkv_MCD, wq, wk, num_q_heads, rotary_dim, cos_M1r, sin_signed_M1r,
                               eps)  # fmt: skip


class _QKNormRopeFn(torch.autograd.Function):
    """`qk_norm_rope_packed`. Forward: the norm (as `_QKRMSNormFn`) gives a fresh tensor that
    RoPE is written into in place (x * cos + roll(x, r / 2) * sin_signed over its first r dims),
    then one cat with v; without a norm, a clone of qkv is rotated in place. Backward: RoPE's
    transpose (g * cos + roll(g * sin_signed, -r / 2)) on the rotated dims, the norm's backward
    (`_QKRMSNormFn`'s), one cat with v's gradient."""

    @staticmethod
    def forward(ctx, qkv, wq, wk, H, rd, cos, sin, eps):  # type: ignore[override]
        C = qkv.shape[1]
        K = (C - H) // 2
        if wq is None:
            out = qkv.clone()
            rot = out.narrow(1, 0, H + K)
            ctx.save_for_backward(cos, sin)
        else:
            qk, v = qkv.split((H + K, K), dim=1)
            qk, xhat, rstd, table = _qk_norm_forward(qk, wq, wk, H, eps, False)
            rot = qk
            ctx.save_for_backward(cos, sin, xhat, rstd, table)
            ctx.v_dtype = v.dtype
        if rd != qkv.shape[-1]:
            rot = rot.narrow(-1, 0, rd)
        # in place into this forward's own tensor: both products are taken before the write
        torch.add(rot * cos, rot.roll(rd // 2, -1) * sin, out=rot)
        if wq is not None:
            out = torch.cat((qk, v.to(qk.dtype)), dim=1)
        ctx.H, ctx.K, ctx.rd, ctx.x_dtype, ctx.rot_dtype = H, K, rd, qkv.dtype, rot.dtype
        return out

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        H, K, rd = ctx.H, ctx.K, ctx.rd
        saved = ctx.saved_tensors  # read once (activation checkpointing unpacks once)
        cos, sin = saved[:2]
        Dh = g.shape[-1]
        g_qk, g_v = g.split((H + K, K), dim=1)
        if rd == Dh:
            g_qk = _rope_grad(g_qk, cos, sin, ctx.rot_dtype)
        else:
            g_rot, g_keep = g_qk.split((rd, Dh - rd), dim=-1)
            g_qk = torch.cat((_rope_grad(g_rot, cos, sin, ctx.rot_dtype), g_keep), dim=-1)
        gwq = gwk = None
        if len(saved) == 2:  # no norm
            return torch.cat((g_qk, g_v), dim=1), None, None, None, None, None, None, None
        xhat, rstd, table = saved[2:]
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            gwq, gwk = _qk_norm_weight_grads(g_qk, xhat, table, H, ctx.x_dtype)
        g_x = _rms_norm_grad_x(g_qk, xhat, rstd, table, ctx.x_dtype)
        g_qkv = torch.cat((g_x, g_v.to(ctx.x_dtype)), dim=1)
        return g_qkv, gwq, gwk, None, None, None, None, None


def _rope_grad(
    g: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, x_dtype: torch.dtype
) -> torch.Tensor:
    """The gradient of x * cos + roll(x, r / 2) * sin_signed at x (dtype `x_dtype`): as
    autograd forms it, each product's gradient cast to x's dtype before the two are added
    (bf16 activations with float32 tables under autocast: the same rounding)."""
    t_cos, t_sin = g * cos, g * sin_signed
    if t_cos.dtype != x_dtype:
        t_cos, t_sin = t_cos.to(x_dtype), t_sin.to(x_dtype)
    return t_cos + t_sin.roll(-(g.shape[-1] // 2), -1)


ZEROS: dict[tuple, torch.Tensor] = {}
"""The constants shared by every layer: `shared_zeros`', `shared_arange`'s, `step_full`'s and
`kept_full`'s tensors (one cache: `ZEROS.clear()` makes the next step a cold one)."""


def shared_zeros(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A zero tensor of `shape` (a constant of the config, e.g. (E, D)) in `like`'s dtype and
    device, made once and shared (read only: out-of-place ops start from it, e.g. a per-expert
    bias gradient's index_add: one op where new_zeros + an in-place op are two)."""
    key = (shape, like.dtype, like.device)
    z = ZEROS.get(key)
    if z is None:
        with torch.inference_mode(False), torch.no_grad():
            z = ZEROS[key] = torch.zeros(shape, dtype=like.dtype, device=like.device)
    return z


def shared_arange(n: int, device: torch.device) -> torch.Tensor:
    """arange(n) (int64), made once per n and device and shared (read only; outside inference
    mode, so training forwards may use it too), e.g. the experts' ids for their offsets."""
    key = ("arange", n, device)
    t = ZEROS.get(key)
    if t is None:
        with torch.inference_mode(False), torch.no_grad():
            t = ZEROS[key] = torch.arange(n, device=device)
    return t


def step_zeros(rows: int, row_shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """Zeros (rows, *row_shape) as `shared_zeros`, for shapes whose row count changes from step
    to step (the tokens of a batch): one tensor kept per row shape, remade when the row count
    changes, so the layers of one step share it (e.g. the routers' (N, E) logit gradients) and
    the cache stays bounded."""
    return step_full(rows, row_shape, 0, like.dtype, like.device)


def step_full(
    rows: int, row_shape: tuple[int, ...], value: float | bool, dtype: torch.dtype, device
) -> torch.Tensor:
    """`step_zeros` filled with `value` (read only: out-of-place ops start from it)."""
    key = ("rows", row_shape, value, dtype, device)
    t = ZEROS.get(key)
    if t is None or t.shape[0] != rows:
        with torch.inference_mode(False), torch.no_grad():
            t = ZEROS[key] = torch.full((rows, *row_shape), value, dtype=dtype, device=device)
    return t


KEPT_MAX_ROWS = 1024
"""`kept_full` keeps constants of at most this many rows (decode batches; not long prefills)."""
KEPT_MAX = 64
"""`kept_full` keeps at most this many constants (never evicted, so the cache is bounded)."""


def kept_full(
    rows: int, row_shape: tuple[int, ...], value: float | bool, dtype: torch.dtype, device
) -> torch.Tensor | None:
    """A constant (rows, *row_shape) filled with `value` for inference forwards, kept for the
    process and never replaced (a captured CUDA graph reads it by address, so a step-to-step
    cache like `step_full`, which frees the old tensor, would leave the graph reading freed
    memory), or None when it is too large (`KEPT_MAX_ROWS`) or the cache is full (`KEPT_MAX`):
    the caller then makes its own."""
    key = ("kept", rows, row_shape, value, dtype, device)
    t = ZEROS.get(key)
    if t is None:
        if rows > KEPT_MAX_ROWS or sum(1 for k in ZEROS if k[0] == "kept") >= KEPT_MAX:
            return None
        with torch.inference_mode(False), torch.no_grad():
            t = ZEROS[key] = torch.full((rows, *row_shape), value, dtype=dtype, device=device)
    return t


class CosSin(tuple):
    """(cos, sin) tables (B, T, Dh), a plain 2-tuple to unpack, that also keeps the tables of the
    fused inference RoPE (`fused`), built once per forward instead of once per layer."""

    def fused(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos (B, T, 1, Dh), sin with its first half negated (B, T, 1, Dh)): RoPE is then
        x * cos + roll(x, Dh/2) * sin_signed, bitwise the same as with rotate_half (negating a
        factor is exact), in four ops per call."""
        tables = self.__dict__.get("_fused")
        if tables is None:
            cos_BTD, sin_BTD = self
            half = sin_BTD.shape[-1] // 2
            sign_D = torch.ones(sin_BTD.shape[-1], dtype=sin_BTD.dtype, device=sin_BTD.device)
            sign_D[:half] = -1
            tables = (cos_BTD[:, :, None], (sin_BTD * sign_D)[:, :, None])
            self.__dict__["_fused"] = tables
        return tables


def rope_cos_sin(
    position_ids_BT: torch.Tensor,
    head_dim: int,
    theta: float,
    dtype: torch.dtype,
    yarn: YarnRope | None = None,
) -> CosSin:
    """cos/sin tables (B, T, Dh) for the given absolute positions. Computed per call from the
    positions (no max-length table), in float32, then cast to `dtype`. `yarn`: YaRN-scaled
    frequencies and cos/sin multiplier (model/rope.py)."""
    # the frequencies are a constant of the config: made once (rope.inv_freq_cached)
    inv_freq, scaling = rope.inv_freq_cached(head_dim, theta, yarn, position_ids_BT.device)
    return CosSin(rope.cos_sin(position_ids_BT, inv_freq, scaling, dtype))


def _rope_BTND(
    x_BTND: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """RoPE on the (B, T, heads, Dh) layout (the fused inference path); `out`: written there
    (no autograd; may be x itself: the products are taken before the sum is written)."""
    if isinstance(cos_sin, CosSin):
        cos_BT1D, sin_signed_BT1D = cos_sin.fused()
        rolled = x_BTND.roll(x_BTND.shape[-1] // 2, -1)
        return torch.add(x_BTND * cos_BT1D, rolled * sin_signed_BT1D, out=out)
    cos_BTD, sin_BTD = cos_sin
    x1, x2 = x_BTND.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return torch.add(x_BTND * cos_BTD[:, :, None], rotated * sin_BTD[:, :, None], out=out)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def packed_rope_tables(
    cos_MD: torch.Tensor, sin_MD: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed training path's RoPE tables, built once per forward: (cos, signed sin), each
    (M, 1, Dh) to broadcast over the heads, with the sign of rotate_half folded into sin, so
    RoPE is x * cos + x.roll(Dh / 2) * sin_signed: 4 ops forward and 4 backward per call instead
    of ~15 (bitwise the same: the sign moves from x to sin)."""
    s1, s2 = sin_MD.chunk(2, dim=-1)
    return cos_MD[:, None], torch.cat((-s1, s2), dim=-1)[:, None]


def _rope_packed(x_MCD: torch.Tensor, cos_M1D: torch.Tensor, sin_signed_M1D: torch.Tensor):
    return x_MCD * cos_M1D + x_MCD.roll(x_MCD.shape[-1] // 2, dims=-1) * sin_signed_M1D


def linear(
    x: torch.Tensor, *weights: torch.Tensor, biases: tuple[torch.Tensor, ...] | None = None
) -> torch.Tensor:
    """x @ cat(weights)^T (+ cat(biases), one per weight, when given): F.linear, but with
    autograd a Function with 3-5 ops forward (cat, t, mm or addmm) and 3-6 backward, where
    autograd through cat + F.linear takes ~10 (~15 with biases: a slice per input in cat's
    backward). Under autocast the concatenated weight is cast once."""
    if not torch.is_grad_enabled() or torch.is_autocast_enabled(x.device.type) or x.dim() != 2:
        return F.linear(x, _cat(weights), None if biases is None else _cat(biases))
    if biases is None:
        return _Linear.apply(x, *weights)
    if len(biases) != len(weights):
        raise ValueError(f"linear: {len(biases)} biases for {len(weights)} weights")
    return _Linear.apply(x, *weights, *biases)


def _cat(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The tensors concatenated (no op for one)."""
    return torch.cat(ts) if len(ts) > 1 else ts[0]


class _Linear(torch.autograd.Function):
    """x @ cat(weights)^T, plus cat(biases) when the inputs are weights then one bias each."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        n = sum(1 for p in params if p.dim() == 2)
        weights, biases = params[:n], params[n:]
        w = torch.cat(weights) if len(weights) > 1 else weights[0]
        ctx.save_for_backward(x, w)
        ctx.rows = [wi.shape[0] for wi in weights]
        ctx.has_bias = bool(biases)
        if biases:
            b = torch.cat(biases) if len(biases) > 1 else biases[0]
            return torch.addmm(b, x, w.t())
        return torch.mm(x, w.t())

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        x, w = ctx.saved_tensors
        n = len(ctx.rows)
        gx = torch.mm(g, w) if ctx.needs_input_grad[0] else None
        gws: tuple = (None,) * n
        if any(ctx.needs_input_grad[1 : 1 + n]):
            gw = torch.mm(g.t(), x)
            gws = gw.split(ctx.rows) if n > 1 else (gw,)
        if not ctx.has_bias:
            return (gx, *gws)
        gbs: tuple = (None,) * n
        if any(ctx.needs_input_grad[1 + n :]):
            gb = g.sum(0)
            gbs = gb.split(ctx.rows) if n > 1 else (gb,)
        return (gx, *gws, *gbs)


def apply_rope(x_BNTD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor) -> torch.Tensor:
    cos, sin = cos_BTD[:, None], sin_BTD[:, None]
    return x_BNTD * cos + _rotate_half(x_BNTD) * sin


@dataclass(frozen=True)
class Packing:
    """The real tokens of a right-padded (B, T) training batch laid end to end (M of them):
    the model runs every per-token layer on these M rows only, and attention alone scatters
    them back to (B, T) for the causal kernel. Exact at the real positions because each row's
    real tokens are a prefix (right padding), so no real query attends a padded key."""

    rows_M: torch.Tensor
    """Indices of the real tokens among the B*T (row-major), ascending."""
    batch_size: int
    num_tokens: int
    """T, the padded length."""
    _cache: dict[tuple, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)
    """`unpack`'s zero tables by (lead, row shape, dtype, device) and `_rows`' indices: made by
    the forward's first layer, shared by the others (read only), gone with the Packing."""

    @classmethod
    def from_mask(cls, real_BT: torch.Tensor, num_real: int | None = None) -> Packing:
        """From a bool mask of the real tokens; raises if a row's real tokens are not a prefix.
        `num_real`: the mask's count of real tokens, when the caller knows it on the host (the
        trainer, from its samples' lengths): then no host sync (nonzero_static, no check; right
        padding is the caller's promise). Without it: two host syncs (the check and nonzero)."""
        if real_BT.dtype != torch.bool or real_BT.dim() != 2:
            raise ValueError(f"the real-token mask must be bool (B, T), got {real_BT.dtype} "
                             f"{tuple(real_BT.shape)}")  # fmt: skip
        B, T = real_BT.shape
        if num_real is not None:
            return cls(torch.nonzero_static(real_BT.reshape(-1), size=num_real).squeeze(1), B, T)
        if bool((real_BT[:, 1:] & ~real_BT[:, :-1]).any()):
            raise ValueError(
                "skip_padding_BT must mark a prefix of every row (right padding): a real token "
                "after a padded one would attend keys the packed forward does not compute"
            )
        return cls(real_BT.reshape(-1).nonzero().squeeze(1), B, T)

    def _rows(self, lead: int) -> torch.Tensor:
        """The real rows' indices in the (B, lead + T) layout (`lead` = 0: rows_M), made once
        per Packing: row b * T + t goes to b * (lead + T) + lead + t."""
        if not lead:
            return self.rows_M
        key = ("rows", lead)
        rows = self._cache.get(key)
        if rows is None:
            rows = self._cache[key] = self.rows_M + (self.rows_M // self.num_tokens + 1) * lead
        return rows

    def pack(self, x_N_: torch.Tensor, lead: int = 0) -> torch.Tensor:
        """(B*T, ...) -> (M, ...): the real rows; `lead`: from the (B, lead + T) layout
        (`unpack`'s)."""
        if torch.is_grad_enabled() and x_N_.requires_grad:
            return _Pack.apply(x_N_, self, lead)
        return x_N_.index_select(0, self._rows(lead))

    def unpack(self, x_M_: torch.Tensor, lead: int = 0) -> torch.Tensor:
        """(M, ...) -> (B*T, ...): the real rows in place, zeros at the padding; with `lead`,
        (B*(lead + T), ...): `lead` zero positions before each row's first (attention sinks'
        zero key)."""
        key = (lead, x_M_.shape[1:], x_M_.dtype, x_M_.device)
        zeros_N_ = self._cache.get(key)
        if zeros_N_ is None:
            N = self.batch_size * (lead + self.num_tokens)
            zeros_N_ = self._cache[key] = x_M_.new_zeros((N, *x_M_.shape[1:]))
        # out of place onto the shared zeros: one op per call (new_zeros + index_copy: two)
        return zeros_N_.index_copy(0, self._rows(lead), x_M_)


class _Pack(torch.autograd.Function):
    """`Packing.pack` with autograd: the gradient is `unpack`ed onto the Packing's shared zeros
    (one op per call; index_select's own backward makes new zeros and index_adds: two). The
    same gradient: the rows are distinct, so adding onto zeros and copying are one thing."""

    @staticmethod
    def forward(ctx, x_N_: torch.Tensor, packing: Packing, lead: int) -> torch.Tensor:  # type: ignore[override]
        ctx.packing, ctx.lead = packing, lead
        return x_N_.index_select(0, packing._rows(lead))

    @staticmethod
    def backward(ctx, g_M_: torch.Tensor):  # type: ignore[override]
        return ctx.packing.unpack(g_M_, ctx.lead), None, None


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """b can be copied into a in place here (an inference tensor only inside inference mode)."""
    writable = not a.is_inference() or torch.is_inference_mode_enabled()
    return writable and a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


class Attention(nn.Module):
    """Grouped-query attention, Qwen3 flavour: RMSNorm on each q/k head before RoPE, no biases.

    In eval mode without autograd (`model.eval()` + `torch.no_grad` / `inference_mode`: the
    engine's decode) the forward takes a fused path with fewer ops per layer (decode is per-op
    overhead bound on CPU): one matmul against a cached concatenation of q/k/v_proj, one RMSNorm
    and one RoPE over the q and k heads together. The cache (one extra copy of the q/k/v
    weights) lives only while the module stays in eval mode: `train()`/`eval()` drop it, because
    an optimizer may update the weights in place without moving their version counters
    (`AdamW(fused=True)` does not), so a cache kept across training steps would serve stale
    q/k/v weights. Within eval mode it is rebuilt whenever one of those parameters changes
    (in-place `copy_`, e.g. the engine's weight hot-swap, or a new storage after `.to`),
    detected by the parameters' version counters and storage pointers. With autograd, or in
    train mode, the three projections and two norms run separately, as transformers does."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        layer_idx: int,
        *,
        qkv_bias: bool = False,
        out_bias: bool = False,
        qk_norm: str = "per_head",
        clip_qkv: float | None = None,
        rotary_dim: int | None = None,
        sinks: bool = False,
        sliding_window: int | None = None,
    ) -> None:
        """The variants (config/model.py): `qkv_bias`/`out_bias` (Linear biases), `qk_norm`
        ("per_head": weights (Dh,); "full": over the whole q / k projection, weights (H*Dh,),
        (K*Dh,), as OLMoE; "none"), `clip_qkv` (clamp q, k, v after the norm, as OLMoE),
        `rotary_dim` (RoPE on the first that many dims of each head; None: all), `sinks` (a
        learned sink logit per query head, `self.sinks` (H,)), `sliding_window` (keys a query
        sees, itself included; model/attention_variants.py). The default
        (Qwen3) runs the op-lean paths below; any variant runs `_forward_variant`."""
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads={num_heads} not divisible by num_key_value_heads={num_kv_heads}"
            )
        if qk_norm not in ("per_head", "full", "none"):
            raise ValueError(f"qk_norm={qk_norm!r}; expected per_head, full or none")
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(
                f"rotary dims {rotary_dim} must be even and within head_dim={head_dim}"
            )
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.layer_idx = layer_idx
        self.qk_norm_kind, self.clip_qkv, self.rotary_dim = qk_norm, clip_qkv, rotary_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=out_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if qk_norm == "per_head":
            self.q_norm = RMSNorm(head_dim, eps)
            self.k_norm = RMSNorm(head_dim, eps)
        elif qk_norm == "full":
            self.q_norm = RMSNorm(num_heads * head_dim, eps)
            self.k_norm = RMSNorm(num_kv_heads * head_dim, eps)
        self.sinks: nn.Parameter | None = None
        if sinks:
            self.sinks = nn.Parameter(torch.zeros(num_heads))
        self.sliding_window = sliding_window
        self.variant = not (
            qk_norm == "per_head"
            and not qkv_bias
            and not out_bias
            and clip_qkv is None
            and rotary_dim == head_dim
            and not sinks
            and sliding_window is None
        )
        """True when some variant is on: the forward then runs `_forward_variant`."""
        self._fused: tuple[tuple[tuple[int, int], ...], torch.Tensor, ...] | None = None
        self.fused_inference = True
        """Use the fused q/k/v weights cached by (version, pointer) in no-grad forwards. Off for
        FSDP-sharded models, whose unsharded weights are rewritten in place by collectives
        that do not move the version counter."""

    def train(self, mode: bool = True) -> Attention:
        self._fused = None  # see the class docstring: weights may change between modes
        return super().train(mode)

    def _fused_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(qkv weight ((H + 2K) * Dh, D), q/k norm weight (H + K, Dh), its (H + K, 1, Dh)
        view), rebuilt on change."""
        params = (
            self.q_proj.weight, self.k_proj.weight, self.v_proj.weight,
            self.q_norm.weight, self.k_norm.weight,
        )  # fmt: skip
        key = tuple((p._version, p.data_ptr()) for p in params)
        if self._fused is None or self._fused[0] != key:
            H, K, Dh = self.num_heads, self.num_kv_heads, self.head_dim
            with torch.no_grad():
                w_qkv = torch.cat(params[:3])
                w_norm = torch.cat((params[3].expand(H, Dh), params[4].expand(K, Dh)))
                if self._fused is not None and _same_layout(self._fused[1], w_qkv):
                    # Rebuilt into the same storage (a weight hot-swap): a captured CUDA graph
                    # that reads these copies then computes with the new weights.
                    w_qkv = self._fused[1].copy_(w_qkv)
                    w_norm = self._fused[2].copy_(w_norm)
            self._fused = (key, w_qkv, w_norm, w_norm[:, None])
        return self._fused[1], self._fused[2], self._fused[3]

    def refresh_inference_weights(self) -> None:
        """Bring the fused q/k/v copies up to date after an in-place weight update (in their
        storage, when they exist); the eager forward does this on its own, a replayed graph
        does not run Python."""
        if self._fused is not None:
            with torch.inference_mode():
                self._variant_weights() if self.variant else self._fused_weights()

    def _fused_qkv(
        self, x_BTD: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, _ = x_BTD.shape
        H, K, Dh = self.num_heads, self.num_kv_heads, self.head_dim
        w_qkv, w_norm, w_norm_C1D = self._fused_weights()
        qkv = F.linear(x_BTD, w_qkv)
        if T == 1:
            # one token per row (decode): (B, heads, 1, Dh) is the order the projection holds,
            # so no transposes (decode is per-op overhead bound); the (H + K, Dh) norm table
            # and the (B, 1, 1, Dh) RoPE tables broadcast over it through size-1 dims
            qk, v_BKTD = qkv.view(B, H + 2 * K, 1, Dh).split((H + K, K), dim=1)
            w_norm = w_norm_C1D
        else:
            qk, v_BTKD = qkv.view(B, T, H + 2 * K, Dh).split((H + K, K), dim=2)
            v_BKTD = v_BTKD.transpose(1, 2)
        if x_BTD.dtype == torch.float32:  # no cast ops (decode is per-op overhead bound)
            qk = w_norm * F.rms_norm(qk, (Dh,), eps=self.q_norm.eps)
        else:
            qk = w_norm * F.rms_norm(qk.float(), (Dh,), eps=self.q_norm.eps).to(x_BTD.dtype)
        qk = _rope_BTND(qk, cos_sin)
        q_BHTD, k_BKTD = (qk if T == 1 else qk.transpose(1, 2)).split((H, K), dim=1)
        return q_BHTD, k_BKTD, v_BKTD

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache | None = None,
        packing: Packing | None = None,
    ) -> torch.Tensor:
        """(B, T, D) -> (B, T, D); with `packing` (training without a cache) x is (M, D), so is
        the output (see `Packing`), and cos_sin are `packed_rope_tables`."""
        if self.variant:
            return self._forward_variant(x_BTD, cos_sin, cache, packing)
        if packing is not None:
            return self._forward_packed(x_BTD, cos_sin, packing)
        B, T, _ = x_BTD.shape
        if (
            torch.is_grad_enabled()
            or self.training
            or not self.fused_inference
            or self.q_norm.eps != self.k_norm.eps  # type: ignore[union-attr]
        ):
            q = self.q_norm(self.q_proj(x_BTD).view(B, T, self.num_heads, self.head_dim))
            k = self.k_norm(self.k_proj(x_BTD).view(B, T, self.num_kv_heads, self.head_dim))
            v = self.v_proj(x_BTD).view(B, T, self.num_kv_heads, self.head_dim)
            cos, sin = cos_sin
            q_BHTD = apply_rope(q.transpose(1, 2), cos, sin)
            k_BKTD = apply_rope(k.transpose(1, 2), cos, sin)
            v_BKTD = v.transpose(1, 2)
        else:
            q_BHTD, k_BKTD, v_BKTD = self._fused_qkv(x_BTD, cos_sin)
        if cache is None:
            out_BHTD = causal_attend(q_BHTD, k_BKTD, v_BKTD)
        else:
            out_BHTD = cache.attend(self.layer_idx, q_BHTD, k_BKTD, v_BKTD)
        if T == 1:  # (B, H, 1, Dh) holds its elements in (B, 1, H, Dh) order: no transpose op
            return self.o_proj(out_BHTD.reshape(B, 1, -1))
        return self.o_proj(out_BHTD.transpose(1, 2).reshape(B, T, -1))

    def _forward_packed(
        self, x_MD: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], packing: Packing
    ) -> torch.Tensor:
        """Projections, norms and RoPE on the M real tokens; SDPA on the padded layout (zeros
        at the padding, which no real query sees); the same values as `forward` at the real
        positions (tests/unit/test_model.py)."""
        M = x_MD.shape[0]
        H, K, Dh = self.num_heads, self.num_kv_heads, self.head_dim
        B, T = packing.batch_size, packing.num_tokens
        # Few ops (the trainer's step is launch-bound on a GPU): q, k and v as one matmul
        # against their concatenated weights, q and k normed (per-head weights) and rotated
        # together; C = H + 2K heads. apply_rope broadcasts the (M, Dh) tables over the heads.
        # (split, not slicing: its backward is one cat, a slice's a zero-filled full-size copy)
        qkv_w = (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)
        qkv_MCD = linear(x_MD, *qkv_w).view(M, H + 2 * K, Dh)
        if self.q_norm.eps == self.k_norm.eps:
            # norm, RoPE and the v heads in one Function (`qk_norm_rope_packed`)
            norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            qkv_MCD = qk_norm_rope_packed(qkv_MCD, H, Dh, *cos_sin, norm)
        else:
            qk_MCD, v_MKD = qkv_MCD.split((H + K, K), dim=1)
            q_MHD, k_MKD = qk_MCD.split((H, K), dim=1)
            qk_MCD = torch.cat((self.q_norm(q_MHD), self.k_norm(k_MKD)), dim=1)
            qk_MCD = _rope_packed(qk_MCD, *cos_sin)
            # one scatter for q, k and v together
            qkv_MCD = torch.cat((qk_MCD, v_MKD.to(qk_MCD.dtype)), dim=1)
        qkv_BTCD = packing.unpack(qkv_MCD).view(B, T, H + 2 * K, Dh)
        # one transpose, then the split: the same strided views as three transposes (2 ops
        # fewer forward and backward)
        q_BHTD, k_BKTD, v_BKTD = qkv_BTCD.transpose(1, 2).split((H, K, K), dim=1)
        out_BHTD = causal_attend(q_BHTD, k_BKTD, v_BKTD)
        return linear(packing.pack(out_BHTD.transpose(1, 2).reshape(B * T, H * Dh)),
                      self.o_proj.weight)  # fmt: skip

    def _variant_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(q/k/v weight ((H + 2K) * Dh, D), their bias or None) for no-grad forwards, cached
        by the parameters' (version, pointer) as `_fused_weights`."""
        params = [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]
        biases = [self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]
        has_bias = biases[0] is not None
        if has_bias:
            params += biases  # type: ignore[arg-type]
        key = tuple((p._version, p.data_ptr()) for p in params)
        if self._fused is None or self._fused[0] != key:
            with torch.no_grad():
                w_qkv = torch.cat(params[:3])
                b_qkv = torch.cat(params[3:]) if has_bias else w_qkv.new_zeros(0)
                if self._fused is not None and _same_layout(self._fused[1], w_qkv):
                    w_qkv = self._fused[1].copy_(w_qkv)  # in place: see `_fused_weights`
                    b_qkv = self._fused[2].copy_(b_qkv)
            self._fused = (key, w_qkv, b_qkv)
        return self._fused[1], (self._fused[2] if has_bias else None)

    def _project_variant(self, x_ND: torch.Tensor) -> torch.Tensor:
        """x (..., D) -> q, k, v projections concatenated (..., (H + 2K) * Dh)."""
        if not torch.is_grad_enabled() and not self.training and self.fused_inference:
            w_qkv, b_qkv = self._variant_weights()
            return F.linear(x_ND, w_qkv, b_qkv)
        weights = (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)
        if self.q_proj.bias is None:
            return linear(x_ND, *weights)
        biases = (self.q_proj.bias, self.k_proj.bias, self.v_proj.bias)
        return linear(x_ND, *weights, biases=biases)  # type: ignore[arg-type]

    def _per_head_norm(self, qk: torch.Tensor, one: bool = False) -> torch.Tensor:
        """Per-head RMSNorm of q and k heads together (..., H + K, Dh), or with `one`
        (..., H + K, 1, Dh): the q and k norm weights as one (H + K, Dh) table (or its
        (H + K, 1, Dh) view), cached by version in no-grad forwards."""
        H, K, Dh = self.num_heads, self.num_kv_heads, self.head_dim
        wq, wk = self.q_norm.weight, self.k_norm.weight  # type: ignore[union-attr]
        eps = self.q_norm.eps  # type: ignore[union-attr]
        if torch.is_grad_enabled():
            return rms_norm_qk(qk, wq, wk, H, eps, one)
        key = (wq._version, wq.data_ptr(), wk._version, wk.data_ptr())
        cached = self.__dict__.get("_norm_table")
        if cached is None or cached[0] != key:
            table = torch.cat((wq.expand(H, Dh), wk.expand(K, Dh)))
            cached = (key, table, table.view(H + K, 1, Dh))
            self.__dict__["_norm_table"] = cached
        w = cached[2] if one else cached[1]
        if qk.dtype == torch.float32:
            return w * F.rms_norm(qk, (Dh,), eps=eps)
        return w * F.rms_norm(qk.float(), (Dh,), eps=eps).to(qk.dtype)

    def _qk_same_width(self) -> bool:
        """The full-width q and k norms can run as one (equal widths and eps, plain weights)."""
        qn, kn = self.q_norm, self.k_norm
        return (self.num_heads == self.num_kv_heads and qn is not None and kn is not None
                and qn.eps == kn.eps and not qn.weight_in_float32
                and not kn.weight_in_float32)  # fmt: skip

    def _lean_packed_heads(self) -> bool:
        """The packed training forward's q/k norm and RoPE go through `qk_norm_rope_packed`:
        with autograd, no clip, a per-head norm of one eps or none, and something for it to
        save (a norm or partial rotary; a bare full rotation costs autograd no more)."""
        if not torch.is_grad_enabled() or self.clip_qkv is not None:
            return False
        if self.qk_norm_kind == "per_head":
            return self.q_norm.eps == self.k_norm.eps  # type: ignore[union-attr]
        return self.qk_norm_kind == "none" and self.rotary_dim < self.head_dim

    def _forward_variant(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache | None,
        packing: Packing | None,
    ) -> torch.Tensor:
        """The forward for every variant (biases, q/k norm full or none, clip_qkv, partial
        rotary): x (B, T, D), or (M, D) with `packing`; same contract as `forward`."""
        H, K, Dh, rd = self.num_heads, self.num_kv_heads, self.head_dim, self.rotary_dim
        # One new token per row (decode): heads laid out (B, heads, 1, Dh), the order a
        # (B, 1, heads * Dh) projection already holds, so attention needs no transposes (decode
        # is per-op overhead bound); the RoPE tables (B, 1, 1, Dh) broadcast over it as well.
        one = packing is None and x.dim() == 3 and x.shape[1] == 1
        lead, head_dim = (x.shape[:1], -3) if one else (x.shape[:-1], -2)

        def heads(t: torch.Tensor, n: int) -> torch.Tensor:
            return t.view(*lead, n, 1, Dh) if one else t.view(*lead, n, Dh)

        qkv = self._project_variant(x)
        ready: torch.Tensor | None = None  # packed q/k/v heads made by one Function
        if self.qk_norm_kind == "full" and torch.is_grad_enabled() and self._qk_same_width():
            # OLMoE in training: q and k (the same width: multi-head) normed by one RMSNorm
            # over a (..., 2, H * Dh) view with the two weights as one (2, H * Dh) table, and
            # the clips as `clamp`: ~20 ops fewer forward + backward than two norms, a cat and
            # autograd's clamp; the same values (each row normed over its own width)
            qk, v = qkv.split((2 * H * Dh, K * Dh), dim=-1)
            w_qk = torch.stack((self.q_norm.weight, self.k_norm.weight))  # type: ignore[union-attr]
            qk = rms_norm(qk.view(*x.shape[:-1], 2, H * Dh), w_qk, self.q_norm.eps)  # type: ignore[union-attr]
            qk, v = heads(qk, H + K), heads(v, K)
            if self.clip_qkv is not None:
                qk, v = clamp(qk, self.clip_qkv), clamp(v, self.clip_qkv)
        elif self.qk_norm_kind == "full":
            if self.clip_qkv is not None:  # one clamp over q, k and v (OLMoE: after the norm)
                q, k, v = qkv.split((H * Dh, K * Dh, K * Dh), dim=-1)
                qkv = torch.cat((self.q_norm(q), self.k_norm(k), v), dim=-1)  # type: ignore[misc]
                qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
                qk, v = heads(qkv, H + 2 * K).split((H + K, K), dim=head_dim)
            else:
                q, k, v = qkv.split((H * Dh, K * Dh, K * Dh), dim=-1)
                q, k = self.q_norm(q), self.k_norm(k)  # type: ignore[misc]
                qk, v = heads(torch.cat((q, k), dim=-1), H + K), heads(v, K)
        elif packing is not None and self._lean_packed_heads():
            # training, packed: norm, RoPE and the v heads in one Function (see
            # `qk_norm_rope_packed`), straight to the unpack below
            norm = None
            if self.qk_norm_kind == "per_head":
                norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)  # type: ignore[union-attr]
            ready = qk_norm_rope_packed(heads(qkv, H + 2 * K), H, rd, *cos_sin, norm)
        else:
            if self.clip_qkv is not None and self.qk_norm_kind == "none":
                qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
            qk, v = heads(qkv, H + 2 * K).split((H + K, K), dim=head_dim)
            if self.qk_norm_kind == "per_head":
                qk = self._per_head_norm(qk, one)
                if self.clip_qkv is not None:
                    qk, v = clamp(qk, self.clip_qkv), clamp(v, self.clip_qkv)
        if ready is not None:  # rotated already
            qkv = ready
        elif rd == Dh:
            qk = _rope_packed(qk, *cos_sin) if packing is not None else _rope_BTND(qk, cos_sin)
        elif packing is None and not torch.is_grad_enabled():
            # partial rotary without autograd: RoPE written over the first rd dims of each head
            # in place (qk is this forward's own tensor: the norm's or the clamp's output, or
            # the q/k heads of the projection's; v's dims are not touched), so no cat (decode
            # is per-op overhead bound); the same values
            rot = qk[..., :rd]
            _rope_BTND(rot, cos_sin, out=rot)
        else:
            rot, keep = qk.split((rd, Dh - rd), dim=-1)
            rot = _rope_packed(rot, *cos_sin) if packing is not None else _rope_BTND(rot, cos_sin)
            qk = torch.cat((rot, keep), dim=-1)
        # with sinks, packed: one zero position before each row (`lead`), the sink's zero key
        # (and a query whose output is dropped), instead of padding k and v in every layer
        lead = int(packing is not None and self.sinks is not None)
        if packing is not None:  # one scatter to the (B, T) layout, attention, one gather
            if ready is None:
                qkv = torch.cat((qk, v.to(qk.dtype)), dim=-2)
            B, T = packing.batch_size, packing.num_tokens + lead
            qkv = packing.unpack(qkv, lead).view(B, T, H + 2 * K, Dh)
            # one transpose, then the split (as `_forward_packed`)
            q_BHTD, k_BKTD, v_BKTD = qkv.transpose(1, 2).split((H, K, K), dim=1)
        elif one:  # already (B, heads, 1, Dh)
            B, T = qk.shape[0], 1
            q_BHTD, k_BKTD = qk.split((H, K), dim=1)
            v_BKTD = v
        else:  # no cat and split again (decode is per-op overhead bound)
            B, T = qk.shape[:2]
            q_BHTD, k_BKTD = qk.transpose(1, 2).split((H, K), dim=1)
            v_BKTD = v.transpose(1, 2)
        if cache is None:
            out_BHTD = variant_attend(q_BHTD, k_BKTD, v_BKTD, self.sliding_window, self.sinks,
                                      sink_key_first=bool(lead))  # fmt: skip
        else:
            out_BHTD = cache.attend(self.layer_idx, q_BHTD, k_BKTD, v_BKTD,
                                    window=self.sliding_window, sinks_H=self.sinks)  # fmt: skip
        if packing is not None:  # `linear`: fewer autograd ops than nn.Linear's
            out_MD = packing.pack(out_BHTD.transpose(1, 2).reshape(B * T, H * Dh), lead)
            o_bias = None if self.o_proj.bias is None else (self.o_proj.bias,)
            return linear(out_MD, self.o_proj.weight, biases=o_bias)
        if T == 1:  # (B, H, 1, Dh) holds its elements in (B, 1, H, Dh) order: no transpose op
            return self.o_proj(out_BHTD.reshape(B, 1, H * Dh))
        return self.o_proj(out_BHTD.transpose(1, 2).reshape(B, T, H * Dh))


class MLP(nn.Module):
    """SwiGLU FFN: down(silu(gate(x)) * up(x)). Used for dense layers and the shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and torch.is_grad_enabled():
            # the packed training path: gate and up as one `linear` (a Function of 3 ops forward,
            # 3-4 backward; autograd through three nn.Linear takes ~2x that)
            gate, up = linear(x, self.gate_proj.weight, self.up_proj.weight).chunk(2, dim=-1)
            return linear(F.silu(gate) * up, self.down_proj.weight)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
