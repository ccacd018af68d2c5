"""Aten ops and host syncs of the engine's decode step (issue 30): the model over the slot cache
at the `mid` shape with 64 rows runs <= 800 ops and no host sync, and the engine's whole decode
step (forward + sampling + bookkeeping) is one callable that reads nothing back before its one
device-to-host copy."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import pytest
import torch

from slipstream.bench.models import MODELS
from slipstream.config.engine import EngineConfig
from slipstream.config.model import ModelConfig
from slipstream.engine import GenerateRequest, NativeEngine, SamplingParams
from slipstream.engine.batch import Group, Row, RunningBatch
from slipstream.engine.decode import DecodeStep, sample_rows, static_moe
from slipstream.engine.kv_cache import Part, SlotKVCache
from slipstream.engine.routing import RoutingRecorder
from slipstream.model import MoEForCausalLM
from slipstream.model.moe_block import Experts
from slipstream.observe.op_count import count_ops

MAX_DECODE_OPS = 800  # issue 30's bound at mid / 64 rows (3,890 at f59355b)


def test_count_ops_counts_ops_and_host_syncs():
    x = torch.arange(6.0)
    c = count_ops(lambda: (x * 2 + 1).sum())
    assert (c.ops, c.syncs) == (3, 0)
    assert c.by_name["aten::mul"] == 1
    c = count_ops(lambda: (int(x.max()), torch.nonzero(x > 2)))
    assert c.syncs == 2 and set(c.sync_ops()) == {"aten::_local_scalar_dense", "aten::nonzero"}
    with torch.inference_mode():  # item is not decomposed there
        assert count_ops(lambda: x.max().item()).sync_ops() == {"aten::item": 1}


@pytest.mark.parametrize(("E", "k", "D", "I"), [(8, 2, 16, 12), (6, 3, 8, 4)])
def test_static_experts_equal_the_reference_loop_without_host_sync(E, k, D, I):  # noqa: E741
    torch.manual_seed(0)
    ex = Experts(E, D, I)
    ex.gate_up_proj.data.normal_(0, 0.5)
    ex.down_proj.data.normal_(0, 0.5)
    x = torch.randn(13, D)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(13)])
    ids[:4] = torch.arange(k)  # crowd some experts, leave others empty
    w = torch.rand(13, k)
    with torch.inference_mode():
        ref = ex(x, ids, w, impl="loop")
        c = count_ops(lambda: ex(x, ids, w, impl="static"))
        torch.testing.assert_close(ex(x, ids, w, impl="static"), ref, atol=1e-5, rtol=1e-5)
    assert c.syncs == 0 and c.by_name["aten::_grouped_mm"] == 2


def _mid_model(vocab: int) -> MoEForCausalLM:
    """The `mid` preset, random init; built on meta and materialised once (no second init)."""
    cfg = ModelConfig(vocab_size=vocab, max_position_embeddings=128, **MODELS["mid"])
    with torch.device("meta"):
        model = MoEForCausalLM(cfg)
    model = model.to_empty(device="cpu")
    model.init_weights()
    return model.eval()


def _prefilled_batch(model: MoEForCausalLM, prompts: list[list[int]], params: SamplingParams,
                     slot_len: int) -> RunningBatch:  # fmt: skip
    """A running batch holding one row per prompt, prefilled the way the engine admits them."""
    cache = SlotKVCache.for_model(model, len(prompts), slot_len)
    batch = RunningBatch(cache, model.config.vocab_size, "cpu")
    parts, offset = [], 0
    for i, p in enumerate(prompts):
        g = Group(f"r{i}", p, params, seed=i, deliver=print, fail=print, start_s=0.0)
        batch.add(Row(g, 0, frozenset()), len(p))
        parts.append(Part(i, offset, len(p)))
        offset += len(p)
    ids = torch.tensor([t for p in prompts for t in p])[None]
    pos = torch.cat([torch.arange(len(p)) for p in prompts])[None]
    cache.begin_mixed(torch.empty(0, dtype=torch.long), -1, parts)
    with static_moe(RoutingRecorder(model).blocks):
        logits = model(ids, position_ids_BT=pos, cache=cache).logits_BTV[0]
    last = torch.tensor([part.offset + part.length - 1 for part in parts])
    batch.fill_uniforms(0)
    sample_rows(batch, logits[last], batch.params_for(len(prompts)), len(prompts))
    return batch


def _model_decode_step(model: MoEForCausalLM, batch: RunningBatch, routing: RoutingRecorder,
                       rows: int) -> Callable[[], None]:  # fmt: skip
    """The model's decode step over the batch's cache for its first `rows` rows, as DecodeStep
    runs it (without sampling and bookkeeping): what the op counts measure."""
    pos_B, ids_B1 = batch.pos_N[:rows], batch.last_N[:rows, None]

    def forward() -> None:
        batch.cache.begin_decode(pos_B, batch.max_pos(rows))
        with static_moe(routing.blocks):
            model(ids_B1, position_ids_BT=pos_B[:, None], cache=batch.cache)

    return forward


def test_mid_decode_step_ops_and_syncs():
    """The model's decode step over the engine's cache at `mid` (hidden 1024, 16 layers, 16/4
    heads, 32 experts top-4), 64 rows: <= 800 aten ops, 0 host syncs. Then the engine's whole
    step (DecodeStep: forward + sampling + bookkeeping) on the same rows: no host sync before
    its one host copy."""
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = _mid_model(vocab=32_000)
    rows = 64
    prompts = [torch.randint(3, 32_000, (4,)).tolist() for _ in range(rows)]
    with torch.inference_mode():
        batch = _prefilled_batch(model, prompts, SamplingParams(temperature=1.0, top_p=0.9),
                                 slot_len=16)  # fmt: skip
        routing = RoutingRecorder(model)
        fwd = count_ops(_model_decode_step(model, batch, routing, rows))
        step = DecodeStep(model, batch, routing, cuda_graphs=False)
        out: list = []
        whole = count_ops(lambda: out.append(step(rows)))
    print(f"mid / {rows} rows: model decode step {fwd.ops} ops ({fwd.syncs} host syncs); whole "
          f"engine step {whole.ops} ops ({whole.syncs} host syncs; "
          f"{time.perf_counter() - t0:.1f} s with the build)")  # fmt: skip
    assert fwd.syncs == 0, fwd.sync_ops()
    assert fwd.ops <= MAX_DECODE_OPS, fwd.top()
    # the engine step's one host read of its results (a .cpu() copy on a GPU), nothing else
    assert whole.sync_ops() == {"Tensor.tolist": 1}, whole.sync_ops()
    assert len(out[0].tokens) == rows and all(0 <= t < 32_000 for t in out[0].tokens)
    assert batch.gen_N[:rows].tolist() == [2] * rows and batch.pos_N[:rows].tolist() == [5] * rows


def test_decode_step_matches_the_engine():
    """DecodeStep on a hand-built batch samples what the engine samples for the same requests
    (greedy and seeded), so the callable counted above is the engine's step."""
    cfg = ModelConfig(vocab_size=50, max_position_embeddings=64, hidden_size=32,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16)  # fmt: skip
    torch.manual_seed(1)
    model = MoEForCausalLM(cfg).eval()
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    for params in (SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True),
                   SamplingParams(temperature=1.0, max_new_tokens=6, seed=0, ignore_eos=True)):  # fmt: skip
        with torch.inference_mode():
            batch = _prefilled_batch(model, prompts, params, slot_len=16)
            step = DecodeStep(model, batch, RoutingRecorder(model), cuda_graphs=False)
            for _ in range(4):
                step(len(prompts))
            got = [batch.out_tok_NS[i, :5].tolist() for i in range(len(prompts))]
        engine_cfg = EngineConfig(max_batch_size=4, kv_cache_tokens=64, max_seq_len=16)
        with NativeEngine(model, engine_cfg, eos_token_ids=[]) as eng:
            # per-request seeds as the hand-built groups have them (seed = i)
            done = eng.generate([
                GenerateRequest(p, dataclasses.replace(params, seed=i))
                for i, p in enumerate(prompts)
            ])  # fmt: skip
        assert got == [c.token_ids[:5] for c in done], params


def test_padded_bucket_at_the_full_key_span_equals_the_exact_step():
    """What a captured graph computes (the live rows padded up to the bucket with free slots,
    the key span fixed at the slot length), run eagerly: the live rows get the same tokens,
    logprobs and finish flags as the exact-size step, and the padding stays in its slots."""
    cfg = ModelConfig(vocab_size=50, max_position_embeddings=64, hidden_size=32,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16)  # fmt: skip
    torch.manual_seed(2)
    model = MoEForCausalLM(cfg).eval()
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    params = SamplingParams(temperature=1.0, top_k=20, max_new_tokens=5, seed=3)
    with torch.inference_mode():
        exact = _prefilled_batch(model, prompts, params, slot_len=12)
        padded = _prefilled_batch(model, prompts, params, slot_len=12)
        # the same rows in a 4-slot batch: slot 3 pads the bucket of 4
        big = SlotKVCache.for_model(model, 4, 12)
        big.k_LNKSD[:, :3], big.v_LNKSD[:, :3] = padded.cache.k_LNKSD, padded.cache.v_LNKSD
        wide = RunningBatch(big, cfg.vocab_size, "cpu")
        for i, row in enumerate(padded.rows):
            wide.add(row, len(prompts[i]))
        for name in ("pos_N", "gen_N", "last_N", "out_tok_NS", "out_lp_NS", "u_NS"):
            getattr(wide, name)[:3] = getattr(padded, name)[:3]
        ref = DecodeStep(model, exact, RoutingRecorder(model), cuda_graphs=False)
        step = DecodeStep(model, wide, RoutingRecorder(model), cuda_graphs=False)
        wide.pos_N[3], wide.gen_N[3] = 11, 9  # stale state of a freed slot
        for _ in range(4):
            want = ref(3)
            step.reset_padding(3, 4)
            wide.params()
            got = step.device_step(4, big.slot_len - 1)
            wide.advance_host(3)
            tokens, logprobs, done = got[:, :3].tolist()
            assert [int(t) for t in tokens] == want.tokens
            torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want.logprobs),
                                       atol=1e-5, rtol=0)  # fmt: skip
            assert [i for i, d in enumerate(done) if d] == want.done
            assert (wide.pos_N[3].item(), wide.gen_N[3].item()) == (1, 1)  # reset, then one step


def test_engine_dtype_sets_weights_and_kv_cache_and_graphs_stay_off_on_cpu():
    cfg = ModelConfig(vocab_size=50, max_position_embeddings=64, hidden_size=32,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16)  # fmt: skip
    torch.manual_seed(3)
    model = MoEForCausalLM(cfg).eval()
    engine_cfg = EngineConfig(max_batch_size=4, kv_cache_tokens=64, max_seq_len=16,
                              dtype="bfloat16", cuda_graphs=True)  # fmt: skip
    with NativeEngine(model, engine_cfg, eos_token_ids=[]) as eng:
        out = eng.generate([GenerateRequest([5, 6, 7], SamplingParams(temperature=0.0, n=2,
                                                                      max_new_tokens=4))])  # fmt: skip
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        assert eng.batch.cache.k_LNKSD.dtype == torch.bfloat16
        assert eng.decoder.cuda_graphs is False and eng.decoder.num_graphs == 0
    assert [len(c.token_ids) for c in out] == [4, 4] and out[0].token_ids == out[1].token_ids
