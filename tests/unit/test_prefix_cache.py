"""The native engine's prefix cache across requests (engine/prefix_cache.py): repeated prompts
and resent multi-turn histories prefill only their new suffix, with the same outputs as full
prefills (greedy tokens equal the no-cache reference decoding; sampled logprobs equal a run
without the cache), LRU eviction within `engine.prefix_cache_tokens`, cleared on weight updates
and /flush_cache."""

from __future__ import annotations

import pytest
import torch
from test_engine_checks import VOCAB, reference_greedy, tiny_model

from slipstream.config.engine import EngineConfig
from slipstream.engine import GenerateRequest, NativeEngine, SamplingParams
from slipstream.engine.kv_cache import SlotKVCache
from slipstream.engine.prefix_cache import PrefixCache

torch.set_num_threads(1)


def engine_cfg(prefix_tokens: int) -> EngineConfig:
    return EngineConfig(kv_cache_tokens=4 * 128, max_seq_len=128, max_batch_size=4,
                        prefix_cache_tokens=prefix_tokens)  # fmt: skip


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(3, VOCAB, (n,), generator=g)]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_repeated_prompt_and_multi_turn_history_hit_and_match_the_reference(model):
    with NativeEngine(model, engine_cfg(1024)) as engine:
        p = prompt(40, 1)
        greedy = SamplingParams(temperature=0, max_new_tokens=12)
        (first,) = engine.generate([GenerateRequest(p, greedy)])
        (again,) = engine.generate([GenerateRequest(p, greedy)])
        assert first.meta["cached_tokens"] == 0 and again.meta["cached_tokens"] == 32
        ref = reference_greedy(model, p, 12, set())
        assert first.token_ids == again.token_ids == ref
        # turn 2 resends turn 1 (prompt + completion) and adds a message
        turn2 = p + first.token_ids + prompt(9, 2)
        (second,) = engine.generate([GenerateRequest(turn2, greedy)])
        # 40 + 12 tokens were stored minus the last sampled one (no KV): 51 -> 3 whole blocks
        assert second.meta["cached_tokens"] == 48
        assert second.token_ids == reference_greedy(model, turn2, 12, set())
        pc = engine.prefix_cache
        assert pc is not None and pc.hit_tokens == 32 + 48
        assert engine.stats["prefix_cache_hit_tokens"] == 80
        assert engine.stats["prefix_cache_query_tokens"] == 40 + 40 + len(turn2)


def test_sampled_outputs_equal_a_run_without_the_cache(model):
    reqs = [
        GenerateRequest(
            prompt(37, 3),
            SamplingParams(temperature=1.0, max_new_tokens=10, seed=s, n=2, top_logprobs=2),
        )  # fmt: skip
        for s in range(3)
    ]
    with NativeEngine(model, engine_cfg(0)) as plain:
        want = [plain.generate([r]) for r in reqs]
    with NativeEngine(model, engine_cfg(512)) as cached:
        got = [cached.generate([r]) for r in reqs]
    assert [c.meta["cached_tokens"] for cs in got for c in cs] == [0, 0, 32, 32, 32, 32]
    for a, b in zip((c for cs in want for c in cs), (c for cs in got for c in cs), strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_copies_of_a_prompt_sent_at_once_prefill_it_once(model):
    """GRPO as G separate requests: the copies wait one step for the first one's prefix."""
    p, other = prompt(40, 6), prompt(20, 7)
    greedy = SamplingParams(temperature=0, max_new_tokens=5)
    with NativeEngine(model, engine_cfg(1024)) as engine:
        out = engine.generate([GenerateRequest(p, greedy) for _ in range(3)]
                              + [GenerateRequest(other, greedy)])  # fmt: skip
        assert [c.meta["cached_tokens"] for c in out] == [0, 32, 32, 0]
        assert engine.stats["prefill_tokens"] == 40 + 2 * 8 + 20
    assert all(c.token_ids == reference_greedy(model, p, 5, set()) for c in out[:3])


def test_prompt_outputs_prefill_in_full(model):
    with NativeEngine(model, engine_cfg(512)) as engine:
        p = prompt(40, 4)
        engine.generate([GenerateRequest(p, SamplingParams(temperature=0, max_new_tokens=2))])
        sp = SamplingParams(temperature=0, max_new_tokens=2, prompt_logprobs=1)
        (c,) = engine.generate([GenerateRequest(p, sp)])
        assert c.meta["cached_tokens"] == 0 and len(c.prompt_logprobs) == 40


def test_weight_update_and_flush_clear_it(model):
    new = tiny_model(seed=7)
    p = prompt(40, 5)
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    with NativeEngine(model, engine_cfg(512)) as engine:
        engine.generate([GenerateRequest(p, greedy)])
        engine.update_weights(1, new.state_dict())
        (c,) = engine.generate([GenerateRequest(p, greedy)])
        assert c.meta["cached_tokens"] == 0  # the old weights' KV is gone
        assert c.token_ids == reference_greedy(new, p, 8, set())
        (c,) = engine.generate([GenerateRequest(p, greedy)])
        assert c.meta["cached_tokens"] == 32
        assert engine.flush_cache()
        (c,) = engine.generate([GenerateRequest(p, greedy)])
        assert c.meta["cached_tokens"] == 0


def test_lru_eviction_within_the_budget():
    slots = SlotKVCache(1, 2, 1, 64, 2)
    pc = PrefixCache(slots, num_tokens=3 * 4, block_tokens=4)  # 3 blocks
    slots.k_LNKSD[0, 0, 0, :, 0] = torch.arange(64.0)
    a, b = list(range(10, 19)), list(range(30, 39))  # 2 whole blocks each (+1 left to prefill)
    # b's 1st block takes the free one, its 2nd evicts the LRU block: a's root, and so a's child
    assert pc.store(a, 0, 9) == 2 and pc.store(b, 0, 9) == 2
    assert pc.lookup(a) == (0, [])  # a's chain lost its root (and so its child)
    hit, blocks = pc.lookup(b)
    assert hit == 8 and len(blocks) == 2 and pc.cached_blocks == 2
    pc.load(blocks, 1)
    assert slots.k_LNKSD[0, 1, 0, :8, 0].tolist() == list(range(8))
    assert pc.lookup(b[:8]) == (4, blocks[:1])  # at least one token is left to prefill
    with pytest.raises(ValueError, match="prefix_cache_tokens"):
        PrefixCache(slots, num_tokens=3, block_tokens=4)


def test_bench_engine_prefix_cache_meets_its_multi_turn_goal(tmp_path, capsys):
    """`bench engine --prefix-cache` on a small run: the multi-turn ratio is within its goal,
    outputs equal the run without the cache, and the JSON carries provenance."""
    import argparse
    import json

    from slipstream.bench.engine_prefix import run_prefix_cache

    args = argparse.Namespace(models="quickstart", vocab=40, seed=0, episodes=4, group=3, turns=4,
                              max_new_tokens=16, max_batch_size=8, device="cpu", threads=1,
                              prefix_cache_tokens=2048, out=str(tmp_path / "engine.json"))  # fmt: skip
    assert run_prefix_cache(args) == 0
    result = json.loads((tmp_path / "engine_prefix_cache.json").read_text())
    grpo, multi = result["results"]
    assert grpo["same_outputs"] and multi["same_outputs"]
    assert multi["ratio"] <= 0.5 and multi["with_cache"]["hit_rate"] > 0.5
    assert result["provenance"]["cpu_model"] is not None and "ratio" in capsys.readouterr().out
