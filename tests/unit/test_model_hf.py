"""Checkpoint and logit parity with transformers' Qwen3-MoE / Qwen3 (both directions)."""

import json

import pytest
import torch

from slipstream.model import (
    ModelConfig,
    MoEForCausalLM,
    load_hf_state_dict,
    load_pretrained,
    save_pretrained,
    state_dict_to_hf,
)

transformers = pytest.importorskip("transformers")

VOCAB = 48


def _hf_moe(norm_topk_prob: bool, mlp_only_layers: list[int], tie: bool = False):
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
        mlp_only_layers=mlp_only_layers,
        rope_theta=1000.0,
        tie_word_embeddings=tie,
    )
    return transformers.Qwen3MoeForCausalLM(cfg).eval()


def _ids(batch: int = 2, seq: int = 11) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    ("norm_topk_prob", "mlp_only_layers"), [(True, [1]), (False, []), (False, [0, 2])]
)
def test_hf_to_ours_logits_match(tmp_path, norm_topk_prob, mlp_only_layers):
    hf = _hf_moe(norm_topk_prob, mlp_only_layers)
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    assert ours.config.norm_topk_prob is norm_topk_prob
    assert ours.config.mlp_only_layers == mlp_only_layers
    assert ours.config.rope_theta == 1000.0
    ids = _ids()
    with torch.no_grad():
        ref = hf(ids, output_router_logits=True)
        out = ours(ids)
    torch.testing.assert_close(out.logits_BTV, ref.logits, atol=1e-5, rtol=1e-5)
    # our aux loss is coef * HF's unweighted load-balancing loss (z-loss coef is 0 by default)
    torch.testing.assert_close(out.aux_loss, ours.config.router_aux_loss_coef * ref.aux_loss)
    # parameter names are exactly transformers 5's in-memory names
    assert set(ours.state_dict()) == set(hf.state_dict())


def test_ours_to_hf_logits_match(tmp_path):
    torch.manual_seed(3)
    cfg = ModelConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        intermediate_size=40,
        decoder_sparse_step=2,
        norm_topk_prob=False,
    )
    ours = MoEForCausalLM(cfg).eval()
    save_pretrained(ours, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "qwen3_moe"
    assert written["architectures"] == ["Qwen3MoeForCausalLM"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    assert hf.config.decoder_sparse_step == 2 and hf.config.num_experts == 8
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits_BTV, hf(ids).logits, atol=1e-5, rtol=1e-5)


def test_fused_transformers5_layout_loads(tmp_path):
    """A state dict in transformers-5 in-memory layout (stacked experts) loads too."""
    hf = _hf_moe(True, [])
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    other = MoEForCausalLM(ours.config).eval()
    load_hf_state_dict(other, {k: v.clone() for k, v in hf.state_dict().items()})
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(other(ids).logits_BTV, ours(ids).logits_BTV)
    per_expert = state_dict_to_hf(other)
    assert "model.layers.0.mlp.experts.5.up_proj.weight" in per_expert
    assert "model.layers.0.mlp.experts.gate_up_proj" not in per_expert


def test_tied_embeddings_round_trip(tmp_path):
    hf = _hf_moe(True, [], tie=True)
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits_BTV, hf(ids).logits, atol=1e-5, rtol=1e-5)


def test_dense_qwen3_checkpoint_loads(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=8,
        tie_word_embeddings=False,
    )
    hf = transformers.Qwen3ForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    assert ours.moe_layer_ids == []
    ids = _ids()
    with torch.no_grad():
        out = ours(ids)
        torch.testing.assert_close(out.logits_BTV, hf(ids).logits, atol=1e-5, rtol=1e-5)
    assert out.aux_loss.item() == 0.0 and out.router_logits is None


def test_unsupported_config_fails_loudly(tmp_path):
    hf = _hf_moe(True, [])
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["attention_bias"] = True
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="attention_bias"):
        load_pretrained(tmp_path)
