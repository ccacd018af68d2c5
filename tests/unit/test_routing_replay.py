"""Rollout routing replay (R3): the trainer's forward can route every position to the experts the
engine used, the gate weights stay those of the live router (so it learns), recorded routing
travels in a Sample and lines up with the trainer's positions and versions, and the mismatch
metrics see what they should."""

from __future__ import annotations

import pytest
import torch

from slipstream.config import load_config
from slipstream.config.engine import EngineConfig
from slipstream.config.model import ModelConfig
from slipstream.engine import GenerateRequest, NativeEngine, SamplingParams
from slipstream.model import MoEForCausalLM
from slipstream.model.moe_block import SparseMoeBlock
from slipstream.rl import routing
from slipstream.rl.trainer import Trainer, collate
from slipstream.rl.types import Batch, Group, Sample, TaskRef


def _model(seed: int = 0, experts: int = 8) -> MoEForCausalLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, moe_intermediate_size=16,
                      num_experts=experts, num_experts_per_tok=2, max_position_embeddings=64,
                      initializer_range=0.2)  # fmt: skip
    return MoEForCausalLM(cfg)


def _top_k(out) -> torch.Tensor:  # noqa: ANN001 - ModelOutput
    """(L, N, k): each MoE layer's own top-k from the forward's router logits."""
    return torch.stack([torch.topk(rl.float(), 2, dim=-1).indices for rl in out.router_logits])


def _used_routing(model: MoEForCausalLM) -> list[torch.Tensor]:
    """Record the ids every block computes with (the engine's capture hook)."""
    used: list[torch.Tensor] = []
    for m in model.modules():
        if isinstance(m, SparseMoeBlock):
            m.routing_sink = lambda ids, used=used: used.append(ids.clone())
    return used


def test_replaying_the_own_routing_equals_the_plain_forward_and_trains_the_router() -> None:
    model = _model()
    ids = torch.randint(3, 40, (2, 9), generator=torch.Generator().manual_seed(1))
    plain = model(ids)
    replayed = model(ids, replay_routing_LNk=_top_k(plain).detach())
    torch.testing.assert_close(replayed.logits_BTV, plain.logits_BTV, atol=1e-6, rtol=0)
    replayed.logits_BTV.sum().backward()
    for m in model.modules():
        if isinstance(m, SparseMoeBlock):
            assert m.gate.weight.grad is not None and m.gate.weight.grad.abs().sum() > 0


def test_routing_recorded_under_older_weights_is_replayed_exactly() -> None:
    old, new = _model(0), _model(0)
    with torch.no_grad():
        for m in new.modules():
            if isinstance(m, SparseMoeBlock):
                m.gate.weight.add_(torch.randn_like(m.gate.weight) * 0.5)  # routing drifted
    ids = torch.randint(3, 40, (3, 8), generator=torch.Generator().manual_seed(2))
    recorded = _top_k(old(ids)).detach()
    assert not torch.equal(_top_k(new(ids)).sort(-1).values, recorded.sort(-1).values)
    used = _used_routing(new)
    out = new(ids, replay_routing_LNk=recorded)
    assert all(torch.equal(u, r) for u, r in zip(used, recorded, strict=True))
    out.logits_BTV.sum().backward()
    assert all(m.gate.weight.grad.abs().sum() > 0
               for m in new.modules() if isinstance(m, SparseMoeBlock))  # fmt: skip


def test_pack_round_trips_uint8_and_int16() -> None:
    small = torch.randint(0, 200, (5, 2, 2))
    data, shape = routing.pack(small)
    assert len(data) == small.numel() and shape == (2, 2)
    big = torch.randint(0, 1000, (5, 2, 2))
    data16, _ = routing.pack(big)
    assert len(data16) == 2 * big.numel()
    s = Sample(
        [1, 2], [3, 4, 5, 6], [0.0] * 4, [0] * 4, routed_experts=data16, routing_shape=(2, 2)
    )
    assert torch.equal(routing.unpack(s), big)
    with pytest.raises(ValueError, match="routed_experts holds"):
        Sample([1, 2], [3, 4], [0.0] * 2, [0] * 2, routed_experts=data16, routing_shape=(2, 2))


def test_a_partial_rollout_spanning_two_versions_replays_per_position() -> None:
    """Positions 0..P-1 (prefill) belong to the first token's version, position j >= P-1 to the
    version of completion token j - P + 1; collate lines the recorded rows up with the trainer's
    positions, and the replayed forward uses them as recorded."""
    P, versions = 3, [5, 5, 6, 6]
    rows = torch.arange(P + len(versions) - 1)[:, None, None].expand(-1, 2, 2) % 8
    rows = torch.stack([rows[..., 0], (rows[..., 1] + 1) % 8], -1)  # 2 distinct experts
    data, shape = routing.pack(rows)
    s = Sample([1, 7, 9], [4, 5, 6, 2], [-1.0] * 4, versions, routed_experts=data,
               routing_shape=shape)  # fmt: skip
    short = Sample([1, 8], [4], [-1.0], [6])  # no routing in this one: not collated
    t = collate([s], pad_id=0, device=torch.device("cpu"), pad_to=8)
    assert t["version_BT"][0].tolist() == [5, 5, 5, 5, 6, 6, -1, -1]
    assert torch.equal(t["routing_BTLk"][0, : len(rows)], rows)
    assert "routing_BTLk" not in collate([s, short], 0, torch.device("cpu"))
    model = _model()
    used = _used_routing(model)
    B, T, L, k = t["routing_BTLk"].shape
    model(
        t["inputs_BT"],
        replay_routing_LNk=t["routing_BTLk"].permute(2, 0, 1, 3).reshape(L, B * T, k),
    )
    for layer in range(L):
        assert torch.equal(used[layer][: len(rows)], rows[:, layer])


def test_engine_recorded_routing_agrees_with_the_trainers_router_at_the_same_weights() -> None:
    """End to end at one version: routing the native engine recorded, carried in Samples, is
    what the trainer's own router picks at those positions (agreement ~1, up to float ties of
    a batched cached forward vs a full one), and replaying it trains."""
    model = _model(3)
    engine = NativeEngine(model, EngineConfig(max_batch_size=8, kv_cache_tokens=512,
                                              max_seq_len=32), eos_token_ids=[2])  # fmt: skip
    try:
        reqs = [GenerateRequest([1, 5 + i, 6, 7], SamplingParams(temperature=1.0, max_new_tokens=6,
                                n=4, seed=i, return_routed_experts=True)) for i in range(2)]  # fmt: skip
        comps = engine.generate(reqs)
    finally:
        engine.close()
    groups = []
    for g in range(2):
        samples = []
        for c in comps[4 * g : 4 * g + 4]:
            data, shape = routing.pack(c.routed_experts)
            samples.append(Sample(c.prompt_ids, c.token_ids, c.logprobs, c.versions,
                                  reward=float(len(c.token_ids) % 2), routed_experts=data,
                                  routing_shape=shape))  # fmt: skip
        groups.append(Group(TaskRef(g, g), samples))
    cfg = load_config(None, ["trainer.routing_replay=r3", "trainer.skip_no_signal=false"])
    assert cfg.rollout.record_routing  # resolved on by r3
    trainer = Trainer(model.train(), cfg.trainer, pad_id=0)
    m = trainer.step(Batch(groups, trainer_version=0, staleness=[0, 0]))
    assert m["router_agreement_s0"] >= 0.98, m
    assert m["logp_abs_diff_s0"] < 1e-4 and abs(m["k3_kl_s0"]) < 1e-6
    assert m["routing_bytes_per_sample"] > 0 and "router_agreement_s1" not in m
