"""Every registered MoE family against transformers' own modeling code (the reference), on the
family's tiny config with every feature on (`Family.tiny_hf_config`) and every bias, norm weight
and correction bias randomised (transformers initialises them to 0/1, which would let a model that
ignores them pass).

Per family: logits (fp32, 1e-5), one training step's loss and gradients, the save/reload round
trip in both directions, greedy decoding of the native engine vs transformers `generate` (mixed
prompt lengths, prefix-cache hits), routing replay (R3) and the correction bias. The EP layout of
each family's MoE block is checked against one process in tests/integration/test_moe_ep.py.
A family is a row of FAMILIES. Names and layouts are compared in transformers' in-memory form
(the family's `weights.to_hf(..., fused_experts=True)`: the identity except for gpt_oss, whose
router is `mlp.router` and experts (E, D, 2I) interleaved there).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from slipstream.config.engine import EngineConfig
from slipstream.engine import GenerateRequest, NativeEngine, SamplingParams
from slipstream.model import MoEForCausalLM, load_pretrained, save_pretrained
from slipstream.model.families import families, family_for
from slipstream.model.moe_block import SparseMoeBlock

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

FAMILIES = ["qwen3_moe", "mixtral", "olmoe", "glm4_moe", "gpt_oss"]
"""The families checked here."""


def _hf_model(model_type: str, seed: int = 0):
    """transformers' model of the family's tiny config, every parameter and buffer random."""
    hf_cfg = dict(family_for(model_type).tiny_hf_config())
    hf_cfg.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **hf_cfg)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # std 0.2: routing margins well above float noise, so no top-k near-ties flip
            base = 1.0 if name.endswith("norm.weight") else 0.0
            p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """(model_type, transformers model, its save_pretrained dir, our model loaded from it)."""
    model_type = request.param
    hf = _hf_model(model_type)
    directory = tmp_path_factory.mktemp(model_type)
    hf.save_pretrained(directory)
    ours = load_pretrained(directory)
    return model_type, hf, directory, ours


def _as_hf(model: MoEForCausalLM, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Internal tensors under transformers' in-memory names and layouts."""
    return family_for(model.config.model_type).weights.to_hf(sd, model.config, True)


def _ids(vocab: int, batch: int = 2, seq: int = 13) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(7))


def test_registry_lists_the_families():
    assert set(FAMILIES) <= set(families())
    with pytest.raises(ValueError, match="not a supported model family.*glm4_moe"):
        family_for("llama")


def test_logits_match_transformers(pair):
    model_type, hf, _, ours = pair
    assert ours.config.model_type == model_type
    assert set(_as_hf(ours, ours.state_dict())) == set(hf.state_dict())  # in-memory names
    ids = _ids(ours.config.vocab_size)
    with torch.no_grad():
        ref = hf(ids).logits
        out = ours(ids).logits_BTV  # eval + no_grad: the fused inference path
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # the packed training path (padding skipped) gives the same logits at the real tokens
    real = torch.ones_like(ids, dtype=torch.bool)
    real[1, 9:] = False
    packed = ours(ids, skip_padding_BT=real).logits_BTV.detach()
    torch.testing.assert_close(packed[0], ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[1, :9], hf(ids[1:, :9]).logits[0].detach(), atol=1e-5,
                               rtol=1e-5)  # fmt: skip


def test_train_step_loss_and_grads_match(pair):
    _, hf, _, ours = pair
    ids = _ids(ours.config.vocab_size)
    hf.train()
    ours.train()
    try:
        hf.zero_grad()
        ours.zero_grad()
        ref = hf(ids, labels=ids)
        ref.loss.backward()
        logits = ours(ids).logits_BTV
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        torch.testing.assert_close(loss, ref.loss, atol=1e-5, rtol=1e-5)
        theirs = dict(hf.named_parameters())
        assert all(p.grad is not None for p in ours.parameters())
        grads = _as_hf(ours, {n: p.grad for n, p in ours.named_parameters()})
        for name, g in grads.items():
            g_ref = theirs[name].grad
            assert g_ref is not None, name
            torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-4, msg=name)
    finally:
        hf.eval()
        ours.eval()


def test_save_round_trip(pair, tmp_path):
    model_type, hf, directory, ours = pair
    save_pretrained(ours, tmp_path)
    hf_json = json.loads((directory / "config.json").read_text())
    our_json = json.loads((tmp_path / "config.json").read_text())
    assert our_json["model_type"] == model_type
    assert our_json["architectures"] == hf_json["architectures"]
    with (
        safe_open(str(directory / "model.safetensors"), "pt") as a,
        safe_open(str(tmp_path / "model.safetensors"), "pt") as b,
    ):
        assert set(a.keys()) == set(b.keys())  # the family's on-disk names
        for k in a.keys():  # noqa: SIM118 - safe_open is not a mapping
            assert torch.equal(a.get_tensor(k), b.get_tensor(k)), k
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = _ids(ours.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, hf(ids).logits, atol=0, rtol=0)
    again = load_pretrained(tmp_path)
    assert again.config == ours.config
    for (n1, t1), (n2, t2) in zip(again.state_dict().items(), ours.state_dict().items(),
                                  strict=True):  # fmt: skip
        assert n1 == n2 and torch.equal(t1, t2), n1


def _record_routing(model: MoEForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """(L_moe, B*T, k) expert ids of a no-grad forward, through the engine's routing sinks."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    seen: list[torch.Tensor] = []
    for b in blocks:
        b.routing_sink = seen.append
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for b in blocks:
            b.routing_sink = None
    return torch.stack(seen)


def test_routing_replay_and_correction_bias(pair):
    model_type, _, directory, _ = pair
    model = load_pretrained(directory)  # a copy: this test changes the correction bias
    ids = _ids(model.config.vocab_size)
    recorded = _record_routing(model, ids)
    with torch.no_grad():
        live_out = model(ids)
        live = live_out.logits_BTV
        # the mismatch metrics' live selection (scheme + correction bias) is what was recorded
        assert torch.equal(model.select_experts(live_out.router_logits), recorded)
        replayed_before = model(ids, replay_routing_LNk=recorded).logits_BTV
    assert torch.equal(replayed_before, live)  # replay reproduces the recorded forward
    model.train()
    out = model(ids, replay_routing_LNk=recorded)
    assert torch.equal(out.logits_BTV.detach(), model(ids).logits_BTV.detach())
    torch.testing.assert_close(out.logits_BTV.detach(), live, atol=1e-5, rtol=1e-5)
    out.logits_BTV.float().logsumexp(-1).sum().backward()
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    for b in blocks:  # the router keeps its gradient under replay
        assert b.gate.weight.grad is not None and b.gate.weight.grad.abs().sum() > 0
        if b.gate.bias is not None:
            assert b.gate.bias.grad is not None and b.gate.bias.grad.abs().sum() > 0
    corrections = [b.gate.e_score_correction_bias for b in blocks]
    if corrections[0] is None:
        return
    model.eval()
    with torch.no_grad():
        for c in corrections:
            c.add_(torch.randn(c.shape, generator=torch.Generator().manual_seed(5)))
        replayed = model(ids, replay_routing_LNk=recorded).logits_BTV
        relive = _record_routing(model, ids)
    assert not torch.equal(relive, recorded)  # the bias does steer live selection ...
    assert torch.equal(replayed, live)  # ... but not the replayed weights
    assert not any(c.requires_grad for c in corrections)  # a frozen buffer, never trained
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in model.state_dict()


def test_engine_greedy_equals_transformers_generate(pair):
    _, hf, _, ours = pair
    V = ours.config.vocab_size
    g = torch.Generator().manual_seed(3)
    base = [int(t) for t in torch.randint(3, V, (9,), generator=g)]
    # mixed lengths, and prompts sharing a prefix (prefix-cache hits on the second pass)
    prompts = [base[:3], base, base + [5, 6], [7], base[:6] + [8, 9, 10, 11]]
    news = [6, 4, 5, 7, 3]
    want = []
    with torch.no_grad():
        for p, n in zip(prompts, news, strict=True):
            out = hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)
            want.append(out[0, len(p) :].tolist())
    cfg = EngineConfig(kv_cache_tokens=8 * 64, max_seq_len=64, max_batch_size=8,
                       prefix_cache_tokens=256)  # fmt: skip
    with NativeEngine(ours, cfg) as engine:
        for _ in range(2):  # the second pass reuses cached prefixes
            reqs = [GenerateRequest(p, SamplingParams(temperature=0, max_new_tokens=n))
                    for p, n in zip(prompts, news, strict=True)]  # fmt: skip
            got = {c.request_id: c.token_ids for c in engine.generate(reqs)}
            assert [got[r.request_id] for r in reqs] == want


def test_engine_routing_replayed_reproduces_its_logprobs(pair):
    """R3 end to end: the engine's sampled tokens, log-probs and recorded experts; the trainer's
    forward over (prompt + completion)[:-1] replaying those experts gives the engine's log-probs
    (temperature 1: log_softmax of the logits) and a gradient at every router."""
    _, _, directory, ours = pair
    model = load_pretrained(directory)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(11)
    prompts = [[int(t) for t in torch.randint(3, V, (n,), generator=g)] for n in (3, 8, 5)]
    cfg = EngineConfig(kv_cache_tokens=8 * 64, max_seq_len=64, max_batch_size=8)
    with NativeEngine(ours, cfg) as engine:
        reqs = [GenerateRequest(p, SamplingParams(temperature=1.0, max_new_tokens=6, seed=i,
                                                  return_routed_experts=True))
                for i, p in enumerate(prompts)]  # fmt: skip
        results = engine.generate(reqs)
    model.train()
    for c in results:
        ids = torch.tensor([(c.prompt_ids + c.token_ids)[:-1]])
        routing_LNk = c.routed_experts.long().permute(1, 0, 2)  # (T, L, k) -> (L, T, k)
        logits = model(ids, replay_routing_LNk=routing_LNk).logits_BTV[0]
        logp = logits.log_softmax(-1)[len(c.prompt_ids) - 1 :]
        taken = logp.gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(taken.detach(), torch.tensor(c.logprobs), atol=1e-4, rtol=0)
        model.zero_grad()
        taken.sum().backward()
        for b in (m for m in model.modules() if isinstance(m, SparseMoeBlock)):
            assert b.gate.weight.grad is not None and b.gate.weight.grad.abs().sum() > 0


def test_weight_push_carries_the_correction_bias(pair, tmp_path):
    """A weight version (the family's HF layout, as the trainer publishes it) hot-swapped into a
    running engine: the engine then routes as a fresh model on those weights, the router's
    correction bias (a buffer, not a parameter) included."""
    model_type, _, directory, ours = pair
    new = load_pretrained(directory)
    with torch.no_grad():
        for name, t in new.state_dict().items():
            if name.endswith("e_score_correction_bias") or name.endswith("gate.weight"):
                t.add_(torch.randn(t.shape, generator=torch.Generator().manual_seed(9)))
    save_pretrained(new, tmp_path)
    g = torch.Generator().manual_seed(4)
    prompts = [[int(t) for t in torch.randint(3, new.config.vocab_size, (n,), generator=g)]
               for n in (4, 7)]  # fmt: skip

    def run(engine: NativeEngine) -> list[torch.Tensor]:
        reqs = [
            GenerateRequest(
                p, SamplingParams(temperature=0, max_new_tokens=5, return_routed_experts=True)
            )
            for p in prompts
        ]
        return [c.routed_experts for c in engine.generate(reqs)]

    cfg = EngineConfig(kv_cache_tokens=4 * 64, max_seq_len=64, max_batch_size=4)
    with NativeEngine(new, cfg) as fresh:
        want = run(fresh)
    with NativeEngine(load_pretrained(directory), cfg) as engine:
        before = run(engine)
        engine.update_weights(1, str(tmp_path))
        got = run(engine)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(before, want, strict=True))


def test_glm_mtp_layers_pass_through(tmp_path):
    """GLM-4.5's multi-token-prediction layers (`model.layers.{num_hidden_layers}.*`) are kept
    and written back unchanged, neither built nor refused; other unknown tensors are refused."""
    from safetensors.torch import load_file, save_file

    hf = _hf_model("glm4_moe")
    hf.save_pretrained(tmp_path / "src")
    sd = load_file(str(tmp_path / "src" / "model.safetensors"))
    L = hf.config.num_hidden_layers
    mtp = {f"model.layers.{L}.eh_proj.weight": torch.randn(32, 64),
           f"model.layers.{L}.mlp.gate.e_score_correction_bias": torch.randn(8)}  # fmt: skip
    save_file({**sd, **mtp}, str(tmp_path / "src" / "model.safetensors"))
    model = load_pretrained(tmp_path / "src")
    assert set(model.hf_passthrough) == set(mtp)
    save_pretrained(model, tmp_path / "out")
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    for name, t in mtp.items():
        assert torch.equal(out[name], t)
    save_file({**sd, "model.layers.0.extra.weight": torch.zeros(2)},
              str(tmp_path / "src" / "model.safetensors"))  # fmt: skip
    with pytest.raises(ValueError, match="unexpected.*extra"):
        load_pretrained(tmp_path / "src")


@pytest.mark.parametrize(
    "preset", ["glm4_moe-quickstart", "mixtral-quickstart", "olmoe-quickstart"]
)
def test_random_init_from_the_model_section_saves_and_reloads(preset, tmp_path):
    """A model built from `[model]` fields (what `slipstream run` random-initialises: each
    family's switches on the quickstart shape, other fields at their defaults) saves as its
    family's checkpoint and reloads with the same logits."""
    from slipstream.bench.models import build_bench_model

    model = build_bench_model(preset, vocab=40, max_pos=64, device="cpu", seed=0)
    save_pretrained(model, tmp_path)
    back = load_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == preset.split("-")[0]
    ids = _ids(40)
    with torch.no_grad():
        assert torch.equal(back(ids).logits_BTV, model(ids).logits_BTV)
