"""Behavioural checks shared by the in-process engine tests (tests/unit/test_engine.py) and the
HTTP server/client tests (tests/integration/test_server.py): each `check_*` takes any `Engine`
plus the reference model whose weights it serves, and compares against plain full forwards
(no KV cache) and an independent, unvectorised re-implementation of the sampling filters.

Also holds the tiny-model factory. No test functions live here (nothing to collect)."""

from __future__ import annotations

import math

import torch

from slipstream.config.model import ModelConfig
from slipstream.engine import Engine, GenerateRequest, SamplingParams
from slipstream.model import MoEForCausalLM

VOCAB = 40
EOS = 2


def tiny_model(seed: int = 0, max_pos: int = 512) -> MoEForCausalLM:
    """A random 2-layer MoE. initializer_range 0.2 makes the logits peaked enough that greedy
    decoding has no near-ties for floating-point noise to flip."""
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=max_pos,
        initializer_range=0.2,
    )
    return MoEForCausalLM(cfg).eval()


def prompts(count: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        n = 1 + (i * 5) % 11
        out.append([int(t) for t in torch.randint(3, VOCAB, (n,), generator=g)])
    return out


@torch.no_grad()
def reference_greedy(
    model: MoEForCausalLM, prompt: list[int], max_new: int, stops: set[int]
) -> list[int]:
    """Token-by-token greedy decoding with full forwards over the whole sequence (no cache)."""
    ids, out = list(prompt), []
    for _ in range(max_new):
        tok = int(model(torch.tensor([ids])).logits_BTV[0, -1].argmax())
        out.append(tok)
        ids.append(tok)
        if tok in stops:
            break
    return out


def reference_logprob(logits_V: torch.Tensor, p: SamplingParams, token: int) -> float:
    """log-probability of `token` under the filtered, renormalised distribution, computed one
    token at a time in float64 (SGLang's filter semantics: top-p on the mass before a token,
    rank < top-k, p >= min_p * p_max; the most likely token always kept)."""
    if p.temperature == 0:
        return 0.0
    probs = torch.softmax(logits_V.double() / p.temperature, dim=-1)
    order = torch.argsort(probs, descending=True, stable=True).tolist()
    kept, before = [], 0.0
    p_max = float(probs[order[0]])
    for rank, tok in enumerate(order):
        pr = float(probs[tok])
        drop = before > p.top_p or (p.top_k != -1 and rank >= p.top_k) or pr < p.min_p * p_max
        if rank == 0 or not drop:
            kept.append(tok)
        before += pr
    assert token in kept, f"sampled token {token} is outside the filtered support"
    return math.log(float(probs[token]) / sum(float(probs[t]) for t in kept))


def check_greedy_matches_reference(engine: Engine, model: MoEForCausalLM, count: int = 6) -> None:
    """Greedy outputs equal no-cache greedy decoding for every request, whatever shares the batch
    (mixed prompt lengths, limits, sampled neighbours) and in whatever order they arrive."""
    ps = prompts(count)
    greedy = [
        GenerateRequest(
            p, SamplingParams(temperature=0, max_new_tokens=4 + 3 * i, stop_token_ids=(EOS,))
        )
        for i, p in enumerate(ps)
    ]
    noise = [
        GenerateRequest(p, SamplingParams(temperature=1.0, max_new_tokens=9, n=2, seed=i))
        for i, p in enumerate(ps[:3])
    ]
    expected = [
        reference_greedy(model, r.prompt_ids, r.params.max_new_tokens, {EOS}) for r in greedy
    ]
    for order in (greedy + noise, noise[:1] + greedy[::-1] + noise[1:]):
        results = engine.generate(order)
        by_id = {c.request_id: c for c in results}
        for r, exp in zip(greedy, expected, strict=True):
            c = by_id[r.request_id]
            assert c.token_ids == exp, (
                f"prompt {r.prompt_ids}: engine {c.token_ids} != reference {exp}"
            )
            assert c.finish_reason == ("stop" if exp and exp[-1] == EOS else "length")
            # greedy: the argmax's logprob under the raw distribution (SGLang's, vLLM's)
            assert len(c.logprobs) == len(exp) and all(
                math.isfinite(lp) and lp <= 0.0 for lp in c.logprobs)  # fmt: skip


@torch.no_grad()
def check_logprobs_match_recompute(engine: Engine, model: MoEForCausalLM) -> None:
    """Behaviour logprobs equal a trainer-side recomputation from one full forward, within 1e-4."""
    settings = [
        SamplingParams(temperature=1.0, max_new_tokens=12, seed=1),
        SamplingParams(temperature=0.7, top_p=0.8, max_new_tokens=12, seed=2),
        SamplingParams(temperature=1.3, top_k=5, max_new_tokens=12, seed=3, n=3),
        SamplingParams(temperature=0.9, min_p=0.1, top_k=20, top_p=0.95, max_new_tokens=12, seed=4),
    ]
    reqs = [
        GenerateRequest(p, sp)
        for p, sp in zip(prompts(len(settings), seed=7), settings, strict=True)
    ]
    results = engine.generate(reqs)
    assert len(results) == sum(sp.n for sp in settings)
    params = {r.request_id: r.params for r in reqs}
    for c in results:
        assert len(c.logprobs) == len(c.token_ids) > 0
        seq = torch.tensor([c.prompt_ids + c.token_ids])
        logits_TV = model(seq).logits_BTV[0]
        for i, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
            ref = reference_logprob(logits_TV[len(c.prompt_ids) - 1 + i], params[c.request_id], tok)
            assert abs(ref - lp) < 1e-4, f"token {i} ({tok}): engine {lp} vs recomputed {ref}"


def check_seeds(engine: Engine) -> None:
    """Same seed -> same samples (alone or in a crowd); different seeds -> different samples."""
    prompt = prompts(1, seed=11)[0]

    def req(seed: int, n: int = 2) -> GenerateRequest:
        return GenerateRequest(
            prompt, SamplingParams(temperature=1.0, max_new_tokens=16, seed=seed, n=n)
        )

    alone = engine.generate([req(5)])
    crowd_reqs = [req(99, 3), req(5), req(6)]
    crowd = engine.generate(crowd_reqs)
    same = [c for c in crowd if c.request_id == crowd_reqs[1].request_id]
    assert [c.token_ids for c in same] == [c.token_ids for c in alone]
    for a, b in zip(alone, same, strict=True):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
    assert alone[0].token_ids != alone[1].token_ids, "the n samples of one request must differ"
    other = [c for c in crowd if c.request_id == crowd_reqs[2].request_id]
    assert other[0].token_ids != alone[0].token_ids


def check_hot_swap(engine: Engine, swap, fresh_outputs, new_version: int) -> None:
    """After `swap()` (update_weights to `new_version`), outputs equal `fresh_outputs` (a fresh
    engine's on the new weights) and every token is tagged with the new version."""
    reqs = hot_swap_requests()
    swap()
    assert engine.version == new_version
    got = engine.generate(reqs)
    assert [c.token_ids for c in got] == [c.token_ids for c in fresh_outputs]
    for a, b in zip(got, fresh_outputs, strict=True):
        assert (
            max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)), default=0) < 1e-4
        )
        assert a.versions == [new_version] * len(a.token_ids)


def hot_swap_requests() -> list[GenerateRequest]:
    ps = prompts(3, seed=21)
    return [
        GenerateRequest(ps[0], SamplingParams(temperature=0, max_new_tokens=10)),
        GenerateRequest(ps[1], SamplingParams(temperature=1.0, max_new_tokens=10, seed=8, n=2)),
        GenerateRequest(
            ps[2], SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=10, seed=9)
        ),
    ]


@torch.no_grad()
def reference_routing(model: MoEForCausalLM, ids: list[int]) -> torch.Tensor:
    """(len(ids), L_moe, k) expert ids that one plain no-cache forward over `ids` routes with:
    each MoE block's `route` outputs, read by wrapping the method (not the engine's sink)."""
    from slipstream.model.moe_block import SparseMoeBlock

    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    seen: list[torch.Tensor] = []
    for b in blocks:
        original = b.route

        def route(*args, _original=original, **kw):  # noqa: ANN002, ANN003, ANN202
            out = _original(*args, **kw)
            seen.append(out[2])
            return out

        b.route = route
    try:
        model(torch.tensor([ids]))
    finally:
        for b in blocks:
            del b.route  # back to the class method
    return torch.stack(seen, dim=1)


def check_routing_matches_forward(engine: Engine, model: MoEForCausalLM) -> None:
    """`routed_experts` of greedy and sampled completions (groups included, sharing a batch with
    requests that do not record) equals the routing of a plain forward over the trainer's
    inputs (prompt + completion)[:-1], prompt rows included, row for row; the samples of one
    group have the same prompt rows; the dtype is the compact one."""
    ps = prompts(4, seed=31)
    rec = [
        GenerateRequest(ps[0], SamplingParams(temperature=0, max_new_tokens=7,
                                              return_routed_experts=True)),
        GenerateRequest(ps[1], SamplingParams(temperature=1.0, max_new_tokens=9, n=3, seed=2,
                                              return_routed_experts=True)),
        GenerateRequest(ps[2], SamplingParams(temperature=0.8, top_k=5, max_new_tokens=5,
                                              seed=3, return_routed_experts=True)),
    ]  # fmt: skip
    plain = [GenerateRequest(ps[3], SamplingParams(temperature=1.0, max_new_tokens=8, seed=4))]
    results = engine.generate(plain + rec)
    cfg = model.config
    for c in results:
        if c.request_id == plain[0].request_id:
            assert c.routed_experts is None
            continue
        assert c.routed_experts is not None
        P, C = len(c.prompt_ids), len(c.token_ids)
        assert c.routed_experts.dtype == torch.uint8
        assert tuple(c.routed_experts.shape) == (P + C - 1, 2, cfg.num_experts_per_tok)
        ref = reference_routing(model, (c.prompt_ids + c.token_ids)[:-1])
        assert torch.equal(c.routed_experts.long(), ref), f"request {c.request_id} #{c.index}"
    group = [c for c in results if c.request_id == rec[1].request_id]
    P = len(group[0].prompt_ids)
    for c in group[1:]:
        assert torch.equal(c.routed_experts[:P], group[0].routed_experts[:P])
