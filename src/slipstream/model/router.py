"""MoE routers: the `Router` module (HF name `mlp.gate`) and the routing schemes that turn its
logits into top-k expert ids and weights.

Shape legend: N tokens, D hidden_size, E experts, k experts per token.

Contract of a `RoutingScheme` (one per `ModelConfig.router_scheme`), shared by live routing and
routing replay (R3):
- `select(logits_NE, correction_E) -> ids_Nk`: the experts a token goes to (no gradient). Only
  live routing calls it; `correction_E` is the router's `e_score_correction_bias` or None.
- `weights(logits_NE, ids_Nk) -> w_Nk` (float32, differentiable in the logits): the combine
  weights of those experts, computed from the live logits alone (never from the correction
  bias). Replay calls it with the recorded ids, so the router keeps its gradient and a
  correction bias changed after recording leaves the replayed weights unchanged.
- `route(logits_NE, correction_E, replay_ids_Nk) -> (w_Nk, ids_Nk)`: `weights(select(...))`, or
  `weights(replayed ids)`; a scheme may fuse the two (softmax_topk does), giving the same values.
Adding a scheme: a class with these three methods, registered in `SCHEMES` under the name
config/model.py's `RouterScheme` lists.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.config.model import ModelConfig
from slipstream.model.layers import kept_full, linear, step_full, step_zeros


def _f32(x: torch.Tensor) -> torch.Tensor:
    """x in float32 without dispatching a no-op cast (decode is per-op overhead bound)."""
    return x if x.dtype == torch.float32 else x.float()


class RoutingScheme(Protocol):
    def select(self, logits_NE: torch.Tensor, correction_E: torch.Tensor | None) -> torch.Tensor:
        """Top-k expert ids (N, k), int64."""
        ...

    def weights(self, logits_NE: torch.Tensor, ids_Nk: torch.Tensor) -> torch.Tensor:
        """Combine weights (N, k), float32, of experts `ids_Nk`, from the live logits."""
        ...

    def route(
        self,
        logits_NE: torch.Tensor,
        correction_E: torch.Tensor | None,
        replay_ids_Nk: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights (N, k) float32, ids (N, k) int64); replayed ids when given."""
        ...


class SoftmaxTopK:
    """Qwen3-MoE / Mixtral / OLMoE: softmax over all E in float32, top-k, renormalised over the k
    if `renormalize` (`norm_topk_prob`; Mixtral always)."""

    def __init__(self, top_k: int, renormalize: bool) -> None:
        self.top_k, self.renormalize = top_k, renormalize

    def select(self, logits_NE: torch.Tensor, correction_E: torch.Tensor | None) -> torch.Tensor:
        return torch.topk(_f32(logits_NE), self.top_k, dim=-1).indices

    def weights(self, logits_NE: torch.Tensor, ids_Nk: torch.Tensor) -> torch.Tensor:
        return self.route(logits_NE, None, ids_Nk)[0]

    def route(self, logits_NE, correction_E, replay_ids_Nk):  # type: ignore[no-untyped-def]
        logits32_NE = _f32(logits_NE)
        if torch.is_grad_enabled() and logits32_NE.requires_grad:
            return _TopK.apply(logits32_NE, replay_ids_Nk, self.top_k, not self.renormalize)
        if self.renormalize:
            # softmax over all E, top-k, renormalised == softmax over the k selected logits (the
            # same function, ~10 fewer ops forward and backward; top-k of the logits is top-k of
            # the probabilities)
            if replay_ids_Nk is None:
                sel_Nk, ids_Nk = torch.topk(logits32_NE, self.top_k, dim=-1)
            else:
                ids_Nk = replay_ids_Nk
                sel_Nk = logits32_NE.gather(-1, ids_Nk)
            return F.softmax(sel_Nk, dim=-1), ids_Nk
        probs_NE = F.softmax(logits32_NE, dim=-1)
        if replay_ids_Nk is None:
            w_Nk, ids_Nk = torch.topk(probs_NE, self.top_k, dim=-1)
            return w_Nk, ids_Nk
        return probs_NE.gather(-1, replay_ids_Nk), replay_ids_Nk


class _TopK(torch.autograd.Function):
    """The softmax routers with autograd (`SoftmaxTopK`, `TopKSoftmax`): the plain route's ops
    and values, the backward by hand. `softmax_first`: w = top-k of softmax(logits) (or its
    values at the replayed ids), backward: the k gradients scattered into (N, E), then one
    softmax backward; else w = softmax of the top-k logits (or of the replayed ids' logits),
    backward: the softmax recomputed, its backward over the k, scattered into (N, E) (out of
    place onto zeros the step's layers share). 2-3 ops backward, where autograd's took ~7 (the trainer step is per-op overhead bound on a
    GPU); the same gradient (scatter of unique ids, as topk's and gather's backward)."""

    @staticmethod
    def forward(ctx, logits_NE, replay_ids_Nk, top_k, softmax_first):  # type: ignore[override]
        if softmax_first:
            probs_NE = F.softmax(logits_NE, dim=-1)
            if replay_ids_Nk is None:
                w_Nk, ids_Nk = torch.topk(probs_NE, top_k, dim=-1)
            else:
                ids_Nk, w_Nk = replay_ids_Nk, probs_NE.gather(-1, replay_ids_Nk)
            ctx.save_for_backward(probs_NE, ids_Nk)
        else:
            if replay_ids_Nk is None:
                sel_Nk, ids_Nk = torch.topk(logits_NE, top_k, dim=-1)
            else:
                ids_Nk, sel_Nk = replay_ids_Nk, logits_NE.gather(-1, replay_ids_Nk)
            w_Nk = F.softmax(sel_Nk, dim=-1)
            # the selected logits, not the output (a saved output costs a detach when saved
            # and one when read back; the softmax is recomputed in backward instead)
            ctx.save_for_backward(sel_Nk, ids_Nk)
        ctx.softmax_first, ctx.num_experts = softmax_first, logits_NE.shape[1]
        ctx.mark_non_differentiable(ids_Nk)
        ctx.set_materialize_grads(False)  # no zero gradient made for the ids
        return w_Nk, ids_Nk

    @staticmethod
    def backward(ctx, g_w_Nk, g_ids):  # type: ignore[override]
        if g_w_Nk is None:
            return None, None, None, None
        saved_Nx, ids_Nk = ctx.saved_tensors
        N, E = ids_Nk.shape[0], ctx.num_experts
        if ctx.softmax_first:  # saved: the probabilities (N, E)
            # out of place onto the step's shared zeros (one op; new_zeros + scatter_: two)
            g_probs_NE = torch.scatter(step_zeros(N, (E,), g_w_Nk), 1, ids_Nk, g_w_Nk)
            g_NE = torch._softmax_backward_data(g_probs_NE, saved_Nx, -1, saved_Nx.dtype)
        else:  # saved: the selected logits (N, k)
            w_Nk = F.softmax(saved_Nx, dim=-1)
            g_sel_Nk = torch._softmax_backward_data(g_w_Nk, w_Nk, -1, w_Nk.dtype)
            g_NE = torch.scatter(step_zeros(N, (E,), g_sel_Nk), 1, ids_Nk, g_sel_Nk)
        return g_NE, None, None, None


class SigmoidGroupTopK:
    """DeepSeek-V3 / GLM-4.5 (transformers' `Glm4MoeTopkRouter`): scores = sigmoid(logits)
    (float32); experts chosen on scores + correction bias within the best `topk_group` of
    `n_group` groups (a group scores the sum of its best two); weights = the unbiased scores at
    the chosen ids, divided by their sum + 1e-20 if `renormalize`, times `scaling`."""

    def __init__(
        self, top_k: int, n_group: int, topk_group: int, renormalize: bool, scaling: float
    ) -> None:
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.renormalize, self.scaling = renormalize, scaling

    def select(self, logits_NE: torch.Tensor, correction_E: torch.Tensor | None) -> torch.Tensor:
        with torch.no_grad():
            return self._select_scores(_f32(logits_NE).sigmoid(), correction_E)

    def _select_scores(
        self, scores_NE: torch.Tensor, correction_E: torch.Tensor | None
    ) -> torch.Tensor:
        with torch.no_grad():
            own = correction_E is not None  # scores_NE is then this call's own tensor
            if own:
                scores_NE = scores_NE + correction_E
            if self.n_group > 1:
                N, E = scores_NE.shape
                grouped_NGe = scores_NE.view(N, self.n_group, E // self.n_group)
                # (N, G, 1) throughout: the drop mask comes in the shape masked_fill broadcasts
                # (no unsqueeze op; decode is per-op overhead bound)
                group_NG1 = grouped_NGe.topk(2, dim=-1).values.sum(-1, keepdim=True)
                best_Ng1 = group_NG1.topk(self.topk_group, dim=1, sorted=False).indices
                # the groups left out, marked directly (one op fewer than keep + its negation),
                # out of place from all-True shared by the layers (one op, not two): in
                # inference kept for good (`kept_full`: CUDA graphs read it), else the step's
                shape, dev = (self.n_group, 1), scores_NE.device
                if torch.is_inference_mode_enabled():
                    true_NG1 = kept_full(N, shape, True, torch.bool, dev)
                else:
                    true_NG1 = step_full(N, shape, True, torch.bool, dev)
                if true_NG1 is None:
                    true_NG1 = torch.ones_like(group_NG1, dtype=torch.bool)
                drop_NG1 = torch.scatter(true_NG1, 1, best_Ng1, False)
                if own:  # filled in place: scores_NE shows it, no view back to (N, E)
                    grouped_NGe.masked_fill_(drop_NG1, float("-inf"))
                else:  # the caller's scores (their weights are gathered from them)
                    scores_NE = grouped_NGe.masked_fill(drop_NG1, float("-inf")).view(N, E)
            return torch.topk(scores_NE, self.top_k, dim=-1, sorted=False).indices

    def weights(self, logits_NE: torch.Tensor, ids_Nk: torch.Tensor) -> torch.Tensor:
        return self._weights_scores(_f32(logits_NE).sigmoid(), ids_Nk)

    def _weights_scores(self, scores_NE: torch.Tensor, ids_Nk: torch.Tensor) -> torch.Tensor:
        w_Nk = scores_NE.gather(1, ids_Nk)
        if self.renormalize:
            w_Nk = w_Nk / (w_Nk.sum(dim=-1, keepdim=True) + 1e-20)
        return w_Nk * self.scaling if self.scaling != 1.0 else w_Nk

    def route(self, logits_NE, correction_E, replay_ids_Nk):  # type: ignore[no-untyped-def]
        logits32_NE = _f32(logits_NE)
        if torch.is_grad_enabled() and logits32_NE.requires_grad:
            return _SigmoidRoute.apply(logits32_NE, correction_E, replay_ids_Nk, self)
        # select and weights fused: the sigmoid computed once (decode is per-op overhead bound)
        scores_NE = logits32_NE.sigmoid()
        if replay_ids_Nk is None:
            # `_select_scores` runs under no_grad: its ops record no graph, so no detach op
            ids_Nk = self._select_scores(scores_NE, correction_E)
        else:
            ids_Nk = replay_ids_Nk
        return self._weights_scores(scores_NE, ids_Nk), ids_Nk


class _SigmoidRoute(torch.autograd.Function):
    """`SigmoidGroupTopK.route` with autograd: the forward's ops and values as the plain route
    (sigmoid, selection or replayed ids, gather, renormalisation, scaling), the backward by hand:
    d w_j / d u = scaling * (g_j - sum_i g_i r_i) / d (r = u / d, d = sum u + 1e-20; without
    renormalisation scaling * g), through the sigmoid on the k chosen scores, scattered into the
    (N, E) logits' gradient (out of place onto the step's shared zeros): 7 ops, where
    autograd's backward through the same forward took ~15
    (the trainer step is per-op overhead bound on a GPU). The same gradient up to rounding."""

    @staticmethod
    def forward(ctx, logits_NE, correction_E, replay_ids_Nk, scheme):  # type: ignore[override]
        scores_NE = logits_NE.sigmoid()
        if replay_ids_Nk is None:
            ids_Nk = scheme._select_scores(scores_NE, correction_E)
        else:
            ids_Nk = replay_ids_Nk
        u_Nk = scores_NE.gather(1, ids_Nk)
        r_Nk, d_N1 = u_Nk, None
        if scheme.renormalize:
            d_N1 = u_Nk.sum(dim=-1, keepdim=True) + 1e-20
            r_Nk = u_Nk / d_N1
        w_Nk = r_Nk * scheme.scaling if scheme.scaling != 1.0 else r_Nk
        ctx.save_for_backward(u_Nk, r_Nk, d_N1, ids_Nk)
        ctx.num_experts, ctx.scaling = logits_NE.shape[1], scheme.scaling
        ctx.mark_non_differentiable(ids_Nk)
        ctx.set_materialize_grads(False)  # no zero gradient made for the ids
        return w_Nk, ids_Nk

    @staticmethod
    def backward(ctx, g_w_Nk, g_ids):  # type: ignore[override]
        if g_w_Nk is None:
            return None, None, None, None
        u_Nk, r_Nk, d_N1, ids_Nk = ctx.saved_tensors
        g_Nk = g_w_Nk * ctx.scaling if ctx.scaling != 1.0 else g_w_Nk
        if d_N1 is not None:
            g_Nk = (g_Nk - (g_Nk * r_Nk).sum(dim=-1, keepdim=True)) / d_N1
        g_sel_Nk = torch.ops.aten.sigmoid_backward(g_Nk, u_Nk)
        N = g_sel_Nk.shape[0]
        # out of place onto the step's shared zeros (one op; new_zeros + scatter_add_: two)
        zeros_NE = step_zeros(N, (ctx.num_experts,), g_sel_Nk)
        g_logits_NE = torch.scatter_add(zeros_NE, 1, ids_Nk, g_sel_Nk)
        return g_logits_NE, None, None, None


class TopKSoftmax:
    """GPT-OSS: top-k of the logits (the router's bias included), softmax over the k."""

    def __init__(self, top_k: int) -> None:
        self.top_k = top_k

    def select(self, logits_NE: torch.Tensor, correction_E: torch.Tensor | None) -> torch.Tensor:
        return torch.topk(_f32(logits_NE), self.top_k, dim=-1).indices

    def weights(self, logits_NE: torch.Tensor, ids_Nk: torch.Tensor) -> torch.Tensor:
        return F.softmax(_f32(logits_NE).gather(-1, ids_Nk), dim=-1)

    def route(self, logits_NE, correction_E, replay_ids_Nk):  # type: ignore[no-untyped-def]
        if torch.is_grad_enabled() and logits_NE.requires_grad:
            return _TopK.apply(_f32(logits_NE), replay_ids_Nk, self.top_k, False)
        if replay_ids_Nk is None:
            sel_Nk, ids_Nk = torch.topk(_f32(logits_NE), self.top_k, dim=-1)
            return F.softmax(sel_Nk, dim=-1), ids_Nk
        return self.weights(logits_NE, replay_ids_Nk), replay_ids_Nk


def routing_scheme(cfg: ModelConfig) -> RoutingScheme:
    """The scheme `cfg.router_scheme` names, with its parameters from `cfg`."""
    k = cfg.num_experts_per_tok
    if cfg.router_scheme == "softmax_topk":
        return SoftmaxTopK(k, cfg.norm_topk_prob)
    if cfg.router_scheme == "topk_softmax":
        return TopKSoftmax(k)
    if cfg.router_scheme == "sigmoid_group_topk":
        if cfg.num_experts % cfg.n_group:
            raise ValueError(f"n_group={cfg.n_group} does not divide num_experts={cfg.num_experts}")
        if cfg.topk_group > cfg.n_group:
            raise ValueError(f"topk_group={cfg.topk_group} > n_group={cfg.n_group}")
        if cfg.n_group > 1 and cfg.num_experts // cfg.n_group < 2:
            raise ValueError("sigmoid_group_topk scores a group by its best two experts: "
                             f"num_experts / n_group = {cfg.num_experts // cfg.n_group} < 2")  # fmt: skip
        return SigmoidGroupTopK(
            k, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor
        )
    raise ValueError(f"router_scheme={cfg.router_scheme!r} has no implementation")


class Router(nn.Linear):
    """`mlp.gate`: logits = x @ weight^T (+ bias when `router_bias`), and, with
    `correction_bias`, the `e_score_correction_bias` (E,) float32 persistent buffer (in the state
    dict, so checkpoints and weight pushes carry it; a buffer, so no optimizer updates it).
    `fp32`: logits computed in float32 (sigmoid routers, as transformers keeps them)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        bias: bool = False,
        correction_bias: bool = False,
        fp32: bool = False,
    ) -> None:
        super().__init__(hidden_size, num_experts, bias=bias)
        self.fp32 = fp32
        self.e_score_correction_bias: torch.Tensor | None
        if correction_bias:
            self.register_buffer(
                "e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32)
            )
        else:
            self.e_score_correction_bias = None

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # `.to(bfloat16)` casts every floating buffer; the correction bias stays float32 (as
        # transformers keeps it): bias values ~1e-3 apart would tie in bf16 and flip selections
        out = super()._apply(fn, recurse)
        bias = self.e_score_correction_bias
        if bias is not None and bias.dtype != torch.float32:
            self.e_score_correction_bias = bias.float()
        return out

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        if self.fp32 and x_ND.dtype != torch.float32:
            b = None if self.bias is None else _f32(self.bias)
            return F.linear(x_ND.float(), _f32(self.weight), b)
        # `linear`: with autograd a Function of fewer ops than F.linear's (a biased one: 4)
        return linear(x_ND, self.weight, biases=None if self.bias is None else (self.bias,))
