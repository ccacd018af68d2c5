"""Rank-side checks of the dispatchers against the single-process reference MoE, run by the tests
(tests/integration/test_moe_ep.py) and before timing by `slipstream bench moe-dispatch`.

Shape legend: N tokens per rank, D hidden, W expert width, E experts, K top-k, R ranks.

`reference_check`: every rank builds the same `SparseMoeBlock` (seeded) and its own tokens; the
EP path (`ExpertParallelMoE` with each dispatcher) and the reference (the model's grouped path with
all E experts, run on every rank's tokens concatenated) compute the same loss sum_r <out_r, g_r>;
returned are the max abs differences of outputs, input gradients, router gradients (all-reduced
over ranks) and the local experts' weight gradients, plus each dispatcher's byte meter.
`drop_check`: padded dispatcher with a small capacity; its output must equal the reference with the
dropped assignments' weights zeroed. `routing_check`: uniform random routing, measured hop-1
inter-node rows vs the per-token count of distinct remote nodes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from slipstream.model.moe_block import SparseMoeBlock
from slipstream.moe.base import make_dispatcher
from slipstream.moe.cost_model import distinct_nodes_per_token, random_topk
from slipstream.moe.layer import ExpertParallelMoE
from slipstream.moe.rank_layout import EPGroup

TYPES = ("padded", "exact", "hierarchical")


def _block(D: int, E: int, K: int, W: int, seed: int) -> SparseMoeBlock:
    torch.manual_seed(seed)
    block = SparseMoeBlock(D, E, K, W, norm_topk_prob=True, impl="grouped")
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return block


def _inputs(Ns: list[int], D: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed + 1)
    xs = [torch.randn(n, D, generator=g) for n in Ns]
    gs = [torch.randn(n, D, generator=g) for n in Ns]
    return xs, gs


def _uneven(N: int, R: int) -> list[int]:
    """Token counts per rank: N, then fewer, and one rank with none (real EP batches vary)."""
    return [0 if r == R - 2 else max(1, N - 5 * r) for r in range(R)] if R > 1 else [N]


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().abs().max()) if a.numel() else 0.0


def reference_check(
    group: EPGroup, N: int = 24, D: int = 16, W: int = 8, K: int = 2, seed: int = 0
) -> dict[str, Any]:
    t, r = group.topo, group.rank
    E, R = t.num_experts, t.world_size
    Ns = _uneven(N, R)
    xs, gs = _inputs(Ns, D, seed)
    ref = _block(D, E, K, W, seed)
    x_all = torch.cat(xs).requires_grad_(True)
    out_all, _ = ref(x_all[None])
    (out_all[0] * torch.cat(gs)).sum().backward()
    lo, hi = t.expert_range(r)
    mine = slice(sum(Ns[:r]), sum(Ns[: r + 1]))
    results: dict[str, Any] = {}
    for typ in TYPES:
        # padded: one capacity for all ranks, large enough for no drops -> exact equality
        opts = {"capacity": max(Ns) * K} if typ == "padded" else {}
        block = _block(D, E, K, W, seed)
        moe = ExpertParallelMoE(block, make_dispatcher(typ, group, **opts))
        x = xs[r].clone().requires_grad_(True)
        out, _ = moe(x[None])
        (out[0] * gs[r]).sum().backward()
        gate_grad = moe.block.gate.weight.grad.clone()
        dist.all_reduce(gate_grad)
        le = moe.local_experts
        results[typ] = {
            "out": _maxdiff(out[0], out_all[0, mine]),
            "out_scale": float(out_all.detach().abs().max()),
            "x_grad": _maxdiff(x.grad, x_all.grad[mine]),
            "gate_grad": _maxdiff(gate_grad, ref.gate.weight.grad),
            "gate_up_grad": _maxdiff(le.gate_up_proj.grad, ref.experts.gate_up_proj.grad[lo:hi]),
            "down_grad": _maxdiff(le.down_proj.grad, ref.experts.down_proj.grad[lo:hi]),
            "meter": moe.dispatcher.meter.summary(),
            "tokens": Ns[r],
        }
    return results


def drop_check(
    group: EPGroup, N: int = 32, D: int = 16, W: int = 8, K: int = 2, seed: int = 3
) -> dict[str, Any]:
    """Padded dispatcher at capacity_factor 0.5 on skewed routing (drops guaranteed)."""
    t, r = group.topo, group.rank
    xs, _ = _inputs([N] * t.world_size, D, seed)
    block = _block(D, t.num_experts, K, W, seed)
    # skew: every token picks expert 0 plus one random other, so rank 0 is oversubscribed
    g = torch.Generator().manual_seed(seed + 100 + r)
    other = torch.randint(1, t.num_experts, (N,), generator=g)
    ids = torch.stack([torch.zeros(N, dtype=torch.int64), other], 1)
    w = torch.softmax(torch.randn(N, K, generator=g), 1)
    disp = make_dispatcher("padded", group, capacity_factor=0.5)
    local = ExpertParallelMoE(block, disp).local_experts
    with torch.no_grad():
        recv_x, recv_local, handle = disp.dispatch(xs[r], ids, w)
        out = disp.combine(local.local_forward(recv_x, recv_local), handle)
        ref = block.experts(xs[r], ids, w * ~handle.dropped_NK)
    return {
        "out": _maxdiff(out, ref),
        "num_dropped": handle.num_dropped,
        "dropped_mask_sum": int(handle.dropped_NK.sum()),
        "dropped_total": disp.dropped,
        "assigned_total": disp.assigned,
        "capacity": handle.capacity,
        "expected_dropped": _expected_drops(ids, t, handle.capacity),
    }


def _expected_drops(ids_NK: torch.Tensor, t: Any, capacity: int) -> int:
    per_rank = torch.bincount(t.owner_rank(ids_NK.reshape(-1)), minlength=t.world_size)
    return int((per_rank - capacity).clamp_min(0).sum())


def routing_check(
    group: EPGroup, N: int = 512, D: int = 8, K: int = 4, seed: int = 7
) -> dict[str, Any]:
    """Uniform random routing through exact and hierarchical; hop-1 inter-node rows measured."""
    t, r = group.topo, group.rank
    g = torch.Generator().manual_seed(seed + r)
    ids = random_topk(N, t.num_experts, K, generator=g)
    x = torch.randn(N, D, generator=g)
    w = torch.rand(N, K, generator=g)
    out: dict[str, Any] = {}
    for typ in ("exact", "hierarchical"):
        disp = make_dispatcher(typ, group)
        with torch.no_grad():
            recv_x, _, handle = disp.dispatch(x, ids, w)
            disp.combine(recv_x, handle)
        m = disp.meter
        out[typ] = {
            "inter_payload_rows": m.rows[("dispatch", "inter", "payload")],
            "combine_inter_payload_rows": m.rows[("combine", "inter", "payload")],
            "meter": m.summary(),
        }
    remote = distinct_nodes_per_token(ids, t.num_experts, t.num_nodes) - _own_node_hit(ids, t, r)
    out["distinct_remote_nodes"] = int(remote.sum())
    out["remote_experts"] = int((t.owner_node(ids) != t.node_of(r)).sum())
    out["tokens"] = N
    out["top_k"] = K
    return out


def _own_node_hit(ids_NK: torch.Tensor, t: Any, rank: int) -> torch.Tensor:
    return (t.owner_node(ids_NK) == t.node_of(rank)).any(1).long()


FAMILIES = (
    "qwen3_moe", "mixtral", "olmoe", "glm4_moe", "gpt_oss",
    "qwen3_next", "qwen3_5_moe_text", "deepseek_v3",
)  # fmt: skip
"""Model families whose MoE block `family_check` runs expert-parallel (model/families/). The
hybrid and latent-attention families (issue 48) differ from the others in their attention
layers, which are data-parallel; their MoE blocks (Qwen3-Next's sigmoid-gated shared expert,
DeepSeek-V3's grouped sigmoid router with n_group > 1 and two ungated shared experts) run here."""


def family_check(group: EPGroup, N: int = 20, seed: int = 11) -> dict[str, Any]:
    """Per model family: the MoE block its tiny config builds (`SparseMoeBlock.from_config`:
    the family's routing scheme, router bias / correction bias, shared experts), every
    parameter and the correction bias random, run expert-parallel (exact dispatcher) vs the
    same block in one process over every rank's tokens: max abs differences of outputs, input
    gradients, and the gradients of every replicated parameter (all-reduced: router, shared
    experts) and of the local experts, each relative to max(1, the reference's largest value)."""
    from slipstream.config.model import ModelConfig
    from slipstream.model.families import family_for

    t, r = group.topo, group.rank
    out: dict[str, Any] = {}
    for model_type in FAMILIES:
        family = family_for(model_type)
        cfg = ModelConfig(model_type=model_type, **family.config_from_hf(family.tiny_hf_config()))
        if cfg.num_experts != t.num_experts:
            raise ValueError(f"{model_type}: tiny config has {cfg.num_experts} experts, the "
                             f"EP group {t.num_experts}")  # fmt: skip

        def build(cfg: ModelConfig = cfg) -> SparseMoeBlock:
            torch.manual_seed(seed)
            block = SparseMoeBlock.from_config(cfg)
            with torch.no_grad():
                for p in block.parameters():
                    p.normal_(0.0, 0.3)
                if block.gate.e_score_correction_bias is not None:
                    block.gate.e_score_correction_bias.normal_(0.0, 0.3)
            return block

        Ns = _uneven(N, t.world_size)
        xs, gs = _inputs(Ns, cfg.hidden_size, seed)
        ref = build()
        x_all = torch.cat(xs).requires_grad_(True)
        out_all, _ = ref(x_all)
        (out_all * torch.cat(gs)).sum().backward()
        moe = ExpertParallelMoE(build(), make_dispatcher("exact", group))
        x = xs[r].clone().requires_grad_(True)
        y, _ = moe(x)
        (y * gs[r]).sum().backward()
        mine = slice(sum(Ns[:r]), sum(Ns[: r + 1]))
        lo, hi = t.expert_range(r)

        def rel(a: torch.Tensor, b: torch.Tensor) -> float:
            return _maxdiff(a, b) / max(1.0, float(b.detach().abs().max()) if b.numel() else 0.0)

        diffs = {"out": rel(y, out_all[mine]), "x_grad": rel(x.grad, x_all.grad[mine]),
                 "out_scale": float(out_all.detach().abs().max())}  # fmt: skip
        theirs = dict(ref.named_parameters())
        for name, p in moe.block.named_parameters():
            if name.startswith("experts."):
                diffs[name] = rel(p.grad, theirs[name].grad[lo:hi])
            else:  # replicated: the ranks' gradients add up to the one-process gradient
                g = p.grad.clone()
                dist.all_reduce(g)
                diffs[name] = rel(g, theirs[name].grad)
        bias = moe.block.gate.e_score_correction_bias
        diffs["correction_bias_trainable"] = bias is not None and bias.requires_grad
        out[model_type] = diffs
    return out


def all_checks(group: EPGroup) -> dict[str, Any]:
    """Everything above in one process group (one spawn for the whole test module)."""
    return {
        "reference": reference_check(group),
        "drop": drop_check(group),
        "routing": routing_check(group),
        "families": family_check(group),
    }
