"""The reward model's checkpoint: transformers loads it as Qwen3MoeForSequenceClassification and
scores what we score (fp32, 1e-5), right-padded batches included; and the other way round."""

import json

import pytest
import torch

from slipstream.model import ModelConfig, MoEForCausalLM
from slipstream.model.tokenizer import CharTokenizer
from slipstream.rm.model import (
    MoERewardModel,
    is_reward_checkpoint,
    load_reward_model,
    pad_batch,
    save_reward_model,
    score_ids,
)

transformers = pytest.importorskip("transformers")


def _cfg(tok: CharTokenizer) -> ModelConfig:
    return ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                       max_position_embeddings=64, tie_word_embeddings=True)  # fmt: skip


def test_transformers_loads_and_scores_equal(tmp_path):
    tok = CharTokenizer()
    torch.manual_seed(0)
    policy = MoEForCausalLM(_cfg(tok))
    rm = MoERewardModel.from_policy(policy).eval()
    # the backbone is the policy's, the head is new
    torch.testing.assert_close(rm.model.embed_tokens.weight, policy.model.embed_tokens.weight)
    assert rm.lm_head.weight.shape == (1, 32)
    save_reward_model(rm, tmp_path, tok, {"heldout_accuracy": 0.5})
    assert is_reward_checkpoint(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [
        "Qwen3MoeForSequenceClassification"
    ]
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == "Qwen3MoeForSequenceClassification"
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    texts = ["12+34=46", "7-9=-2", "99+1=100 and more"]
    seqs = [tok.encode_prompt(t) for t in texts]
    assert [hf_tok(t).input_ids for t in texts] == seqs
    ours = score_ids(rm, seqs, tok.pad_id)
    ids_BT, _ = pad_batch(seqs, tok.pad_id)
    with torch.no_grad():
        ref = hf(input_ids=ids_BT).logits[:, 0]
    torch.testing.assert_close(torch.tensor(ours), ref, atol=1e-5, rtol=1e-5)
    # and our loader reads it back to the same scores
    again = load_reward_model(tmp_path)
    torch.testing.assert_close(torch.tensor(score_ids(again, seqs, tok.pad_id)), ref,
                               atol=1e-5, rtol=1e-5)  # fmt: skip


def test_loads_a_transformers_reward_model(tmp_path):
    torch.manual_seed(1)
    cfg = transformers.Qwen3MoeConfig(vocab_size=40, hidden_size=32, intermediate_size=48,
                                      moe_intermediate_size=16, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      num_experts=4, num_experts_per_tok=2, num_labels=1,
                                      pad_token_id=0)  # fmt: skip
    hf = transformers.Qwen3MoeForSequenceClassification(cfg).eval()
    hf.save_pretrained(tmp_path)
    rm = load_reward_model(tmp_path)
    seqs = [[1, 5, 6, 7], [1, 9, 9, 9, 9, 3, 4]]
    ids_BT, _ = pad_batch(seqs, 0)
    with torch.no_grad():
        ref = hf(input_ids=ids_BT).logits[:, 0]
    torch.testing.assert_close(torch.tensor(score_ids(rm, seqs, 0)), ref, atol=1e-5, rtol=1e-5)


def test_two_label_classifier_is_refused(tmp_path):
    cfg = transformers.Qwen3MoeConfig(vocab_size=40, hidden_size=32, intermediate_size=48,
                                      moe_intermediate_size=16, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      num_experts=4, num_experts_per_tok=2, num_labels=2,
                                      pad_token_id=0)  # fmt: skip
    transformers.Qwen3MoeForSequenceClassification(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="num_labels=2; a reward model has one scalar output"):
        load_reward_model(tmp_path)


def test_packed_training_score_equals_padded():
    tok = CharTokenizer()
    torch.manual_seed(2)
    rm = MoERewardModel(_cfg(tok)).eval()
    seqs = [tok.encode_prompt("1+1=2"), tok.encode_prompt("10+10=20, maybe")]
    ids_BT, lengths_B = pad_batch(seqs, tok.pad_id)
    with torch.no_grad():
        a = rm.score(ids_BT, lengths_B)
        b = rm.score_with_aux(ids_BT, lengths_B, skip_padding=True)[0]
        single = [rm.score(*pad_batch([s], tok.pad_id)).item() for s in seqs]
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a, torch.tensor(single), atol=1e-5, rtol=1e-5)
