"""Gated DeltaNet (the linear-attention layer of Qwen3-Next / Qwen3.5 / Qwen3.6), in plain torch,
and the zero-centred RMSNorms of those families.

A GDN layer projects x to q, k, v (through a causal depthwise conv1d + SiLU), a gate z, and per
value head a write strength beta = sigmoid(b) and a decay g = -exp(A_log) * softplus(a + dt_bias)
(log space, <= 0). Its recurrent state S (Hv, Dk, Dv) evolves per token as

    S <- exp(g) * S;  S <- S + k (beta * (v - S^T k))^T;  out = S^T (q / sqrt(Dk))

with q and k L2-normalised. Two forms compute it:
- `chunk_gated_delta_rule`: the chunked (WY / UT-transform) form, one triangular solve per chunk
  of 64 tokens and a scan over chunks; differentiable (prefill and training);
- `recurrent_gated_delta_rule`: one token at a time (decode), carrying S.
They agree within float32 rounding (tests/unit/test_gdn.py). The conv1d carries its own state,
the last `kernel - 1` inputs (`causal_conv1d`).

Sequence packing: `GatedDeltaNet.forward_packed` takes sequences laid end to end with their
boundaries (`cu_seqlens`) and starts each one from a zero recurrent state and a zero conv
window, so every sequence's outputs equal its unpacked forward.

Parameter names are Qwen3.5's (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, `conv1d`,
`dt_bias`, `A_log`, `norm`, `out_proj`); Qwen3-Next's fused, per-key-head-grouped
`in_proj_qkvz`/`in_proj_ba` are converted by `split_qwen3_next_projections` /
`fuse_qwen3_next_projections` at checkpoint load/save. Numerics follow transformers'
`Qwen3NextGatedDeltaNet` (the recurrence in float32 whatever the activation dtype).

Shape legend: B batch, T tokens, D hidden, Hk key heads, Hv value heads, Dk / Dv head widths,
C conv channels (2 Hk Dk + Hv Dv), W conv kernel width, L chunk length, N chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

CHUNK_SIZE = 64
"""Chunk length of the chunked form (transformers' and FLA's default)."""


class ZeroCenteredRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in float32, cast back after the weight (Qwen3-Next/3.5: the
    weight is stored zero-centred and initialised to 0)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)


class RMSNormGated(nn.Module):
    """weight * rms_norm(x) * silu(gate): the GDN output norm, normalised before the gate, the
    weight applied in x's dtype and the gate in float32 (as transformers)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


def causal_conv1d(
    x_BCT: torch.Tensor, weight_CW: torch.Tensor, window_BCw: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv1d + SiLU over T new inputs. `window_BCw` (w = W - 1): the inputs
    before these (zeros when None: a sequence start). -> (output (B, C, T), the new window, the
    last W - 1 inputs)."""
    W = weight_CW.shape[-1]
    B, C, T = x_BCT.shape
    if window_BCw is None:
        window_BCw = x_BCT.new_zeros(B, C, W - 1)
    full_BCS = torch.cat((window_BCw.to(x_BCT.dtype), x_BCT), dim=-1)
    out_BCT = F.conv1d(full_BCS.to(weight_CW.dtype), weight_CW[:, None], groups=C)
    return F.silu(out_BCT).to(x_BCT.dtype), full_BCS[:, :, -(W - 1) :]


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # FLA's and transformers' form (eps inside the root)
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(
    q_BTHD: torch.Tensor,
    k_BTHD: torch.Tensor,
    v_BTHD: torch.Tensor,
    g_BTH: torch.Tensor,
    beta_BTH: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """float32, heads first (B, Hv, T, ...), q/k expanded to the value heads (each key head
    serves Hv/Hk consecutive value heads), L2-normalised, q scaled by 1/sqrt(Dk)."""
    Hk, Hv = k_BTHD.shape[2], v_BTHD.shape[2]
    if Hv != Hk:  # repeat_interleave by expand + reshape: the same copy, never a sync op
        B, T, _, Dk = k_BTHD.shape
        r = Hv // Hk
        q_BTHD = q_BTHD[:, :, :, None].expand(B, T, Hk, r, Dk).reshape(B, T, Hv, Dk)
        k_BTHD = k_BTHD[:, :, :, None].expand(B, T, Hk, r, Dk).reshape(B, T, Hv, Dk)
    q, k, v, beta, g = (
        t.transpose(1, 2).float() for t in (q_BTHD, k_BTHD, v_BTHD, beta_BTH, g_BTH)
    )
    q, k = _l2norm(q), _l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def recurrent_gated_delta_rule(
    q_BTHD: torch.Tensor,
    k_BTHD: torch.Tensor,
    v_BTHD: torch.Tensor,
    g_BTH: torch.Tensor,
    beta_BTH: torch.Tensor,
    state_BHKV: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule one token at a time (decode; T is usually 1). q/k (B, T, Hk, Dk), v
    (B, T, Hv, Dv), g/beta (B, T, Hv); `state_BHKV` (B, Hv, Dk, Dv) float32, zeros when None.
    -> (out (B, T, Hv, Dv) in v's dtype, final state (B, Hv, Dk, Dv) float32)."""
    q, k, v, g, beta = _prepare(q_BTHD, k_BTHD, v_BTHD, g_BTH, beta_BTH)
    B, H, T, Dk = k.shape
    S = q.new_zeros(B, H, Dk, v.shape[-1]) if state_BHKV is None else state_BHKV.float()
    outs = []
    for t in range(T):
        S = S * g[:, :, t].exp()[..., None, None]
        kv_mem_BHV = (S * k[:, :, t, :, None]).sum(-2)
        delta_BHV = (v[:, :, t] - kv_mem_BHV) * beta[:, :, t, None]
        S = S + k[:, :, t, :, None] * delta_BHV[:, :, None, :]
        outs.append((S * q[:, :, t, :, None]).sum(-2))
    out_BHTV = torch.stack(outs, dim=2)
    return out_BHTV.transpose(1, 2).to(v_BTHD.dtype), S


def chunk_gated_delta_rule(
    q_BTHD: torch.Tensor,
    k_BTHD: torch.Tensor,
    v_BTHD: torch.Tensor,
    g_BTH: torch.Tensor,
    beta_BTH: torch.Tensor,
    state_BHKV: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule in chunks of `chunk_size` (prefill, training; differentiable).
    Within a chunk the delta-rule updates are condensed by the UT transform (one unit lower
    triangular solve); a scan over chunks carries the state. Same arguments and results as
    `recurrent_gated_delta_rule`."""
    q, k, v, g, beta = _prepare(q_BTHD, k_BTHD, v_BTHD, g_BTH, beta_BTH)
    B, H, T, Dk = k.shape
    Dv = v.shape[-1]
    L = chunk_size
    pad = (L - T % L) % L
    if pad:  # zero inputs after the end: no write (beta 0), no decay (g 0), outputs dropped
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    N = (T + pad) // L
    q, k, v = (t.reshape(B, H, N, L, -1) for t in (q, k, v))
    g_BHNL, beta_BHNL = g.reshape(B, H, N, L), beta.reshape(B, H, N, L)
    k_beta = k * beta_BHNL[..., None]
    v_beta = v * beta_BHNL[..., None]
    cum_BHNL = g_BHNL.cumsum(-1)
    upper_LL = torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1)
    # decay between positions j <= i of a chunk: exp(cum_i - cum_j); 0 above the diagonal
    decay_BHNLL = (cum_BHNL[..., :, None] - cum_BHNL[..., None, :]).masked_fill(
        upper_LL, -torch.inf
    )
    decay_BHNLL = decay_BHNLL.exp()
    ut_BHNLL = (k_beta @ k.transpose(-1, -2)) * decay_BHNLL
    intra_BHNLL = (q @ k.transpose(-1, -2)) * decay_BHNLL
    # (I + strictly-lower(ut))^-1 applied to v_beta and to the decayed k_beta
    u_BHNLV = torch.linalg.solve_triangular(ut_BHNLL, v_beta, upper=False, unitriangular=True)
    w_BHNLK = torch.linalg.solve_triangular(
        ut_BHNLL, k_beta * cum_BHNL.exp()[..., None], upper=False, unitriangular=True
    )
    q_decayed = q * cum_BHNL.exp()[..., None]
    k_to_end = k * (cum_BHNL[..., -1:] - cum_BHNL).exp()[..., None]
    chunk_decay_BHN11 = cum_BHNL[..., -1].exp()[..., None, None]
    S = q.new_zeros(B, H, Dk, Dv) if state_BHKV is None else state_BHKV.float()
    outs = []
    for n in range(N):
        v_new = u_BHNLV[:, :, n] - w_BHNLK[:, :, n] @ S
        outs.append(q_decayed[:, :, n] @ S + intra_BHNLL[:, :, n] @ v_new)
        S = S * chunk_decay_BHN11[:, :, n] + k_to_end[:, :, n].transpose(-1, -2) @ v_new
    out_BHTV = torch.cat(outs, dim=2)[:, :, :T]
    return out_BHTV.transpose(1, 2).to(v_BTHD.dtype), S


@dataclass
class GDNState:
    """One GDN layer's decode state for B sequences: the conv window (B, C, W - 1) in the
    activation dtype and the recurrent state (B, Hv, Dk, Dv) float32. Fixed size whatever the
    context length. `GatedDeltaNet.forward` updates both in place."""

    conv_BCw: torch.Tensor
    recurrent_BHKV: torch.Tensor


class GatedDeltaNet(nn.Module):
    """The Gated DeltaNet token mixer (Qwen3.5 parameter layout; see the module docstring)."""

    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel_size: int,
        eps: float,
        layer_idx: int,
    ) -> None:
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(
                f"linear_num_value_heads={num_v_heads} not divisible by "
                f"linear_num_key_heads={num_k_heads}"
            )
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel_size = conv_kernel_size
        self.layer_idx = layer_idx
        self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, num_v_heads, bias=False)
        # nn.Conv1d for its parameter shape (C, 1, W) and name; the forward is causal_conv1d
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, conv_kernel_size, groups=self.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.empty(num_v_heads).uniform_(0.01, 16).log())
        self.norm = RMSNormGated(head_v_dim, eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The non-Linear parameters' init (transformers' `_init_weights`): dt_bias 1, A uniform
        in [0.01, 16] (A_log its log), the gated norm's weight 1, the conv PyTorch's default;
        for a model built on the meta device (`MoEForCausalLM.init_weights`)."""
        self.dt_bias.fill_(1.0)
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log())
        self.norm.weight.fill_(1.0)
        self.conv1d.reset_parameters()

    def new_state(self, batch_size: int, dtype: torch.dtype, device: torch.device) -> GDNState:
        """A zero state (sequence starts) for `batch_size` sequences."""
        return GDNState(
            torch.zeros(batch_size, self.conv_dim, self.conv_kernel_size - 1, dtype=dtype,
                        device=device),
            torch.zeros(batch_size, self.num_v_heads, self.head_k_dim, self.head_v_dim,
                        dtype=torch.float32, device=device),
        )  # fmt: skip

    def forward(
        self, x_BTD: torch.Tensor, state: GDNState | None = None, chunk_size: int = CHUNK_SIZE
    ) -> torch.Tensor:
        """(B, T, D) -> (B, T, D). Without `state`: every row starts a sequence (training,
        prefill). With it: continue from it and write the new state into it (in place; one
        token per row takes the recurrent form, more the chunked form)."""
        B, T, _ = x_BTD.shape
        Dk, Dv = self.head_k_dim, self.head_v_dim
        qkv_BCT = self.in_proj_qkv(x_BTD).transpose(1, 2)
        z_BTHV = self.in_proj_z(x_BTD).view(B, T, self.num_v_heads, Dv)
        beta_BTH = self.in_proj_b(x_BTD).sigmoid()
        g_BTH = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x_BTD).float() + self.dt_bias)
        window = None if state is None else state.conv_BCw
        qkv_BCT, new_window = causal_conv1d(qkv_BCT, self.conv1d.weight[:, 0], window)
        q, k, v = qkv_BCT.transpose(1, 2).split((self.key_dim, self.key_dim, self.value_dim), -1)
        q_BTHD, k_BTHD = q.reshape(B, T, -1, Dk), k.reshape(B, T, -1, Dk)
        v_BTHV = v.reshape(B, T, -1, Dv)
        S0 = None if state is None else state.recurrent_BHKV
        if state is not None and T == 1:
            out_BTHV, S = recurrent_gated_delta_rule(q_BTHD, k_BTHD, v_BTHV, g_BTH, beta_BTH, S0)
        else:
            out_BTHV, S = chunk_gated_delta_rule(
                q_BTHD, k_BTHD, v_BTHV, g_BTH, beta_BTH, S0, chunk_size
            )
        if state is not None:
            with torch.no_grad():
                state.conv_BCw.copy_(new_window)
                state.recurrent_BHKV.copy_(S)
        out_BTHV = self.norm(out_BTHV, z_BTHV)
        return self.out_proj(out_BTHV.reshape(B, T, self.value_dim))

    def forward_packed(
        self, x_MD: torch.Tensor, cu_seqlens: list[int], chunk_size: int = CHUNK_SIZE
    ) -> torch.Tensor:
        """Sequences laid end to end (M tokens; sequence i is rows cu_seqlens[i]:cu_seqlens[i+1])
        -> (M, D). Each sequence starts from a zero recurrent state and a zero conv window (the
        boundaries reset both): its rows equal its own unpacked forward. The per-token
        projections run on the M rows; the conv and the recurrence run on the sequences
        scattered to a zero-padded (S, T_max) batch (right padding never reaches a real
        position: both are causal)."""
        if (
            cu_seqlens[0] != 0
            or cu_seqlens[-1] != x_MD.shape[0]
            or any(b < a for a, b in zip(cu_seqlens, cu_seqlens[1:], strict=False))
        ):
            raise ValueError(
                f"cu_seqlens {cu_seqlens} must rise from 0 to the {x_MD.shape[0]} packed tokens"
            )
        rows_M, num_seqs, t_max = _packed_rows(cu_seqlens, x_MD.device)
        x_ND = x_MD.new_zeros(num_seqs * t_max, x_MD.shape[1]).index_copy(0, rows_M, x_MD)
        out_BTD = self.forward(x_ND.view(num_seqs, t_max, -1), None, chunk_size)
        return out_BTD.reshape(num_seqs * t_max, -1).index_select(0, rows_M)


def _packed_rows(cu_seqlens: list[int], device: torch.device) -> tuple[torch.Tensor, int, int]:
    """Row (s * T_max + t) of each packed token in the (S, T_max) padded layout."""
    lengths = [b - a for a, b in zip(cu_seqlens, cu_seqlens[1:], strict=False)]
    t_max = max(lengths, default=0)
    rows = [s * t_max + t for s, n in enumerate(lengths) for t in range(n)]
    return torch.tensor(rows, dtype=torch.long, device=device), len(lengths), t_max


def split_qwen3_next_projections(
    w_qkvz: torch.Tensor,
    w_ba: torch.Tensor,
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
) -> dict[str, torch.Tensor]:
    """Qwen3-Next's `in_proj_qkvz` ((Hk * (2 Dk + 2 r Dv), D), grouped per key head as
    [q, k, v (r heads), z (r heads)], r = Hv / Hk) and `in_proj_ba` ((Hk * 2r, D), per key
    head [b (r), a (r)]) -> Qwen3.5's {in_proj_qkv, in_proj_z, in_proj_b, in_proj_a}."""
    r = num_v_heads // num_k_heads
    D = w_qkvz.shape[-1]
    q, k, v, z = w_qkvz.reshape(num_k_heads, -1, D).split(
        (head_k_dim, head_k_dim, r * head_v_dim, r * head_v_dim), dim=1
    )
    b, a = w_ba.reshape(num_k_heads, 2 * r, D).split((r, r), dim=1)
    return {
        "in_proj_qkv": torch.cat([t.reshape(-1, D) for t in (q, k, v)]),
        "in_proj_z": z.reshape(-1, D),
        "in_proj_b": b.reshape(-1, D),
        "in_proj_a": a.reshape(-1, D),
    }


def fuse_qwen3_next_projections(
    parts: dict[str, torch.Tensor],
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `split_qwen3_next_projections`: -> (in_proj_qkvz, in_proj_ba)."""
    r = num_v_heads // num_k_heads
    Hk, Dk = num_k_heads, head_k_dim
    D = parts["in_proj_qkv"].shape[-1]
    q, k, v = parts["in_proj_qkv"].split((Hk * Dk, Hk * Dk, num_v_heads * head_v_dim))
    per_head = (q.reshape(Hk, Dk, D), k.reshape(Hk, Dk, D), v.reshape(Hk, -1, D),
                parts["in_proj_z"].reshape(Hk, -1, D))  # fmt: skip
    qkvz = torch.cat(per_head, dim=1).reshape(-1, D)
    ba = torch.cat(
        (parts["in_proj_b"].reshape(Hk, r, D), parts["in_proj_a"].reshape(Hk, r, D)), dim=1
    ).reshape(-1, D)
    return qkvz, ba
