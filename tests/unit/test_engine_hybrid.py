"""The native engine serving the hybrid and latent-attention families (qwen3_next,
qwen3_5_moe_text, deepseek_v3 with q_lora_rank set and unset, n_group > 1): greedy decoding equal
to transformers `generate` on mixed-length batches (prompts crossing a GDN chunk boundary, rows
joining while others decode, rows leaving and compacting, a group of n samples sharing its
prefill), across a weight hot-swap, routing capture (R3) replayed by the trainer's forward, and
per-layer decode state (GDN state per slot constant in the context length; MLA's expanded K/V of
two widths). See docs/engine.md "Per-layer state"."""

from __future__ import annotations

import pytest
import torch
from test_engine_ops import _model_decode_step, _prefilled_batch
from test_families_hybrid import _random_hf

from slipstream.config.engine import EngineConfig
from slipstream.engine import GenerateRequest, NativeEngine, SamplingParams
from slipstream.engine.decode import DecodeStep
from slipstream.engine.kv_cache import SlotKVCache
from slipstream.engine.prefix_cache import PrefixCache
from slipstream.engine.routing import RoutingRecorder
from slipstream.model import MoEForCausalLM, load_pretrained, model_config_from_hf
from slipstream.model.families import deepseek_v3, qwen3_5_moe, qwen3_next
from slipstream.model.moe_block import SparseMoeBlock
from slipstream.observe.op_count import count_ops

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

CASES = {
    "qwen3_next": qwen3_next.tiny_hf_config(),
    "qwen3_5_moe_text": qwen3_5_moe.tiny_hf_config(),
    "deepseek_v3": deepseek_v3.tiny_hf_config(),  # q_lora_rank 24, n_group 4
    "deepseek_v3_q_proj": {**deepseek_v3.tiny_hf_config(), "q_lora_rank": None},
}
SLOT_LEN = 96
# 70 tokens cross the GDN chunk of 64 in prefill; 3 slots for 5 requests: later ones join while
# earlier rows decode, and rows leave at different steps (compaction moves their state)
PROMPT_LENS = (3, 70, 9, 1, 20)
NEW_TOKENS = (6, 4, 9, 5, 7)


def _hf(hf_json: dict, seed: int):
    hf = _random_hf(hf_json, seed)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[int(t) for t in torch.randint(3, 96, (n,), generator=g)] for n in PROMPT_LENS]


def _want(hf, prompts: list[list[int]]) -> list[list[int]]:
    with torch.no_grad():
        return [
            hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p) :].tolist()
            for p, n in zip(prompts, NEW_TOKENS, strict=True)
        ]


def _greedy(engine: NativeEngine, prompts: list[list[int]], n: int = 1) -> list[list[int]]:
    reqs = [GenerateRequest(p, SamplingParams(temperature=0, max_new_tokens=k, n=n))
            for p, k in zip(prompts, NEW_TOKENS[: len(prompts)], strict=True)]  # fmt: skip
    futures = [engine.submit(r) for r in reqs]
    out = []
    for f in futures:
        completions = f.result(timeout=120)
        assert all(c.token_ids == completions[0].token_ids for c in completions)  # n samples
        out.append(completions[0].token_ids)
    return out


@pytest.fixture(scope="module", params=list(CASES))
def served(request, tmp_path_factory):
    """(model_type, our model loaded from transformers' checkpoint, transformers' model and
    checkpoint of other random weights for the hot-swap)."""
    hf_json = CASES[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    hf = _hf(hf_json, seed=0)
    hf.save_pretrained(directory)
    other_dir = tmp_path_factory.mktemp(request.param + "_v1")
    other = _hf(hf_json, seed=1)
    other.save_pretrained(other_dir)
    return request.param, hf, load_pretrained(directory), other, other_dir


def test_engine_greedy_equals_transformers_and_across_a_hot_swap(served):
    name, hf, ours, other, other_dir = served
    prompts = _prompts(3)
    want = _want(hf, prompts)
    cfg = EngineConfig(kv_cache_tokens=3 * SLOT_LEN, max_seq_len=SLOT_LEN, max_batch_size=3,
                       prefix_cache_tokens=256)  # fmt: skip
    with NativeEngine(ours, cfg) as engine:
        assert _greedy(engine, prompts) == want
        # second pass: prefix-cache hits (GDN models: up to the last block boundary before a
        # prompt's last token, where the first pass split its prefill and saved the GDN states)
        assert _greedy(engine, prompts) == want
        pc = engine.prefix_cache
        assert pc is not None and engine.stats["prefix_cache_hit_tokens"] >= 64 + 16
        assert pc.needs_snapshots == name.startswith("qwen3")
        # a group of 2 samples: the prefill (GDN state included) is copied to the second slot
        assert _greedy(engine, prompts[:3], n=2) == want[:3]
        engine.update_weights(1, str(other_dir))
        prompts = _prompts(4)
        assert _greedy(engine, prompts) == _want(other, prompts)


def test_engine_routing_capture_replays_its_logprobs(served):
    """R3 through the engine: the experts recorded while sampling, replayed by the trainer's
    forward over prompt + completion, give the engine's log-probs."""
    _, _, ours, _, _ = served
    g = torch.Generator().manual_seed(11)
    prompts = [[int(t) for t in torch.randint(3, 96, (n,), generator=g)] for n in (3, 70, 5)]
    cfg = EngineConfig(kv_cache_tokens=4 * SLOT_LEN, max_seq_len=SLOT_LEN, max_batch_size=4)
    with NativeEngine(ours, cfg) as engine:
        reqs = [GenerateRequest(p, SamplingParams(temperature=1.0, max_new_tokens=5, seed=i,
                                                  return_routed_experts=True))
                for i, p in enumerate(prompts)]  # fmt: skip
        results = engine.generate(reqs)
    num_moe = sum(isinstance(m, SparseMoeBlock) for m in ours.modules())
    with torch.no_grad():
        for c in results:
            ids = torch.tensor([(c.prompt_ids + c.token_ids)[:-1]])
            routing_LNk = c.routed_experts.long().permute(1, 0, 2)  # (T, L, k) -> (L, T, k)
            assert routing_LNk.shape[:2] == (num_moe, ids.shape[1])
            logits = ours(ids, replay_routing_LNk=routing_LNk).logits_BTV[0]
            logp = logits.log_softmax(-1)[len(c.prompt_ids) - 1 :]
            taken = logp.gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(taken, torch.tensor(c.logprobs), atol=1e-4, rtol=0)


def test_decode_state_grows_with_context_only_on_full_attention_layers():
    """Per sequence: the GDN layers' state is a constant; the bytes added per context token are
    exactly the full-attention layers' K and V (1 of qwen3_next's 4 layers)."""
    cfg = model_config_from_hf(qwen3_next.tiny_hf_config())
    model = MoEForCausalLM(cfg)
    short, long = (SlotKVCache.for_model(model, 2, n) for n in (64, 1024))
    assert short.attention_layers == [3] and short.linear_layers == [0, 1, 2]
    a, b = short.bytes_per_slot(), long.bytes_per_slot()
    assert a["linear"] == b["linear"] > 0
    gdn = model.model.layers[0].linear_attn
    conv = gdn.conv_dim * (gdn.conv_kernel_size - 1) * 4  # float32 model
    rec = gdn.num_v_heads * gdn.head_k_dim * gdn.head_v_dim * 4
    assert a["linear"] == 3 * (conv + rec)
    per_token = 1 * 2 * cfg.num_key_value_heads * cfg.head_dim * 4  # 1 layer, K and V
    assert b["attention"] - a["attention"] == (1024 - 64) * per_token
    # the prefix cache's GDN snapshots: as many as fit in its K/V block pool's bytes
    pc = PrefixCache(long, 256)
    assert pc.num_snapshots == pc.nbytes // a["linear"] >= 1
    assert long.snap_rec_LPHKV.shape == (3, pc.num_snapshots, 4, 8, 6)


def test_mla_cache_holds_k_and_v_of_their_own_widths():
    cfg = model_config_from_hf(deepseek_v3.tiny_hf_config())
    cache = SlotKVCache.for_model(MoEForCausalLM(cfg), 2, 16)
    # H heads of K qk_nope + qk_rope = 20 wide and V v_head_dim = 10 wide, every layer
    assert cache.k_LNKSD.shape == (3, 2, 4, 16, 20)
    assert cache.v_LNKSD.shape == (3, 2, 4, 16, 10)
    assert cache.linear_layers == [] and cache.bytes_per_slot()["linear"] == 0


@pytest.mark.parametrize("name", ["qwen3_next", "deepseek_v3"])
def test_decode_step_has_no_host_sync(name):
    """The model's decode step over the slot cache (GDN recurrent step on the slots' states,
    MLA over pages of two widths) reads nothing back; the engine's whole step reads once.
    At a mid-like shape (hidden 1024, 16 layers, 64 rows; docs/engine.md) the model's decode
    step is 2,115 aten ops for a Qwen3.5-like hybrid, 1,569 for MLA, 749 for Qwen3-MoE."""
    torch.manual_seed(0)
    model = MoEForCausalLM(model_config_from_hf(CASES[name])).eval()
    rows = 4
    prompts = [torch.randint(3, 96, (n,)).tolist() for n in (4, 9, 1, 6)]
    with torch.inference_mode():
        batch = _prefilled_batch(model, prompts, SamplingParams(temperature=1.0), slot_len=16)
        routing = RoutingRecorder(model)
        fwd = count_ops(_model_decode_step(model, batch, routing, rows))
        step = DecodeStep(model, batch, routing, cuda_graphs=False)
        whole = count_ops(lambda: step(rows))
    assert fwd.syncs == 0, fwd.sync_ops()
    assert whole.sync_ops() == {"Tensor.tolist": 1}, whole.sync_ops()


def test_prefix_cache_serves_a_gdn_prefix_only_up_to_a_state_snapshot():
    """Bookkeeping of the GDN snapshots: a chain serves up to its block holding one, a full
    pool evicts the least recently used, a clear during a step keeps the snapshot that step is
    writing out of the free list."""
    model = MoEForCausalLM(model_config_from_hf(qwen3_next.tiny_hf_config()))
    cache = SlotKVCache.for_model(model, 2, 64)
    pc = PrefixCache(cache, 48, block_tokens=4)
    assert pc.num_snapshots == 2  # 12,288 B of K/V blocks // 4,320 B of GDN states
    a, b, c = ([k] * 10 for k in (5, 6, 7))
    assert pc.snapshot_point(a[:4], 0) == (0, -1)  # no block boundary before the last token
    at, snap = pc.snapshot_point(a, 0)
    assert at == 8 and snap >= 0
    cache.snap_rec_LPHKV[:, snap] = 1.0
    assert pc.store(a, 0, at, snap) == 2
    assert pc.lookup(a)[0] == 8 and pc.lookup(a[:6] + [9, 9, 9])[0] == 0  # block 1: no states
    hit, blocks = pc.lookup(a + [1])
    pc.load(blocks, 1)
    assert hit == 8 and bool((cache.rec_LNHKV[:, 1] == 1.0).all())
    assert pc.store(b, 0, 8) == 0  # GDN blocks without their states are not kept
    for p in (b, c):  # the pool holds 2: c's snapshot evicts a's chain (least recently used)
        at, snap = pc.snapshot_point(p, 0)
        pc.store(p, 0, at, snap)
    assert pc.lookup(a)[0] == 0 and pc.lookup(c)[0] == 8
    pc.clear()
    at, snap = pc.snapshot_point(a, 0)
    pc.request_clear()  # e.g. /flush_cache while this step's forward writes `snap`
    pc.store(a, 0, at, snap)
    assert sorted(pc._free_snapshots) == [i for i in range(2) if i != snap]
    pc.clear()
    pc.snapshot_point(b, 0)  # a step that fails before its store: the engine releases it
    pc.release_reserved()
    assert sorted(pc._free_snapshots) == [0, 1]
