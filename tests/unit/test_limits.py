"""`bench limits`: the FLOPs-per-token formula against a brute-force count of the real model
(torch's FlopCounterMode over every matmul the forward and backward run), the GEMM shape lists
against the formula, and the measurement API end to end on a tiny model (no timing asserted)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from slipstream.bench import model_flops as mf
from slipstream.bench.gemms import decode_gemms, decode_read_bytes, train_gemms
from slipstream.bench.limits import measure_limits
from slipstream.config.model import ModelConfig
from slipstream.engine.kv_cache import Part, SlotKVCache
from slipstream.model import MoEForCausalLM

# MoE layers with a shared expert, one dense FFN layer, grouped-query attention
TINY = ModelConfig(vocab_size=40, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=8,
                   num_experts_per_tok=2, intermediate_size=24, mlp_only_layers=[1],
                   shared_expert_intermediate_size=8, max_position_embeddings=64)  # fmt: skip


def _model(cfg: ModelConfig = TINY) -> MoEForCausalLM:
    torch.manual_seed(0)
    return MoEForCausalLM(cfg)


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """torch._grouped_mm (the grouped experts; not in the counter's table): 2D x 3D, each of
    the M rows times its group's (K, N) matrix; 2D x 2D (weight gradients), (P, M) x (M, Q)
    split along M into the groups: 2 M K N / 2 P M Q in all."""
    if len(b_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


def _count(fn) -> int:
    # The math SDPA backend runs attention as plain matmuls, which the counter sees (the CPU
    # flash kernel is not in its table); it computes all T keys per query, as causal=False counts.
    mapping = {torch.ops.aten._grouped_mm: _grouped_mm_flops}
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False,
                                                       custom_mapping=mapping) as counter:  # fmt: skip
        fn()
    return counter.get_total_flops()


def test_param_count_matches_the_model() -> None:
    model = _model()
    assert mf.num_params(TINY) == model.num_parameters()
    assert mf.num_params(TINY, active=True) == model.num_parameters(active=True)


@pytest.mark.parametrize("T", [1, 7, 16])
def test_forward_and_train_flops_equal_a_brute_force_count(T: int) -> None:
    model = _model()
    B = 3
    ids = torch.randint(3, TINY.vocab_size, (B, T))
    fwd = _count(lambda: model(ids))
    # the counter sees matmuls only; the MoE combine (k gate-weighted adds per token) is
    # elementwise in the model (combine_topk) and counted by the formula as its FLOPs
    combine = B * T * sum(mf.layer_flops(TINY, i).combine for i in range(3))
    assert fwd + combine == B * T * mf.forward_flops_per_token(TINY, attended_keys=T)

    def fwd_bwd() -> None:
        out = model(ids)
        (out.logits_BTV.sum() + out.aux_loss).backward()

    assert _count(fwd_bwd) + 3 * combine == B * T * mf.train_flops_per_token(TINY, T, causal=False)
    # causal counting differs only in the attention products: (T + 1) / 2 keys per query
    per_key = sum(mf.layer_flops(TINY, i).attention_core_per_key for i in range(3))
    gap = mf.train_flops_per_token(TINY, T, causal=False) - mf.train_flops_per_token(TINY, T)
    assert gap == pytest.approx(3 * per_key * (T - (T + 1) / 2))


def test_decode_flops_equal_a_brute_force_count_of_one_cached_step() -> None:
    model = _model().eval()
    B, P = 2, 9  # 2 rows x top-2 < 8 experts: the engine's grouped expert path (no padding)
    cache = SlotKVCache.for_model(model, B, 32)
    ids = torch.randint(3, TINY.vocab_size, (B, P))
    parts = [Part(b, b * P, P) for b in range(B)]
    with torch.inference_mode():
        cache.begin_mixed(torch.empty(0, dtype=torch.long), -1, parts)
        model(ids.reshape(1, -1), position_ids_BT=torch.arange(P).repeat(B)[None], cache=cache)
        pos_B = torch.full((B,), P)
        cache.begin_decode(pos_B, P)
        step = _count(lambda: model(ids[:, :1], position_ids_BT=pos_B[:, None], cache=cache))
    combine = B * sum(mf.layer_flops(TINY, i).combine for i in range(3))  # elementwise: unseen
    assert step + combine == B * mf.decode_flops_per_token(TINY, context_len=P + 1)


def test_gemm_lists_add_up_to_the_formula() -> None:
    T, seqs = 12, 8
    N = T * seqs  # N * k / E rows per expert exactly
    train = train_gemms(TINY, N, T)
    assert sum(g.count * g.flops_per_call for g in train) == pytest.approx(
        N * mf.train_flops_per_token(TINY, T), rel=1e-12
    )
    batch, ctx = 64, 20
    decode = decode_gemms(TINY, batch, ctx)
    total = sum(g.count * g.flops_per_call for g in decode)
    # rows per touched expert are rounded up: the list never counts less than the formula
    assert total >= batch * mf.decode_flops_per_token(TINY, ctx) * (1 - 1e-12)
    assert total <= batch * mf.decode_flops_per_token(TINY, ctx) * 1.02
    # bytes: the weights a step multiplies by at least once, plus the KV cache it reads
    kv = batch * ctx * 2 * TINY.num_key_value_heads * TINY.head_dim * TINY.num_hidden_layers
    assert decode_read_bytes(TINY, batch, ctx, 4) > 4 * kv


def test_bad_inputs_name_the_value() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        mf.lm_head_flops(TINY.model_copy(update={"vocab_size": 0}))
    with pytest.raises(ValueError, match="num_tokens"):
        train_gemms(TINY, 0, 4)
    with pytest.raises(ValueError, match="parts"):
        measure_limits(TINY, parts=("prefill",))


def test_measure_limits_reports_every_part() -> None:
    lim = measure_limits(TINY, num_tokens=96, seq_len=12, decode_batch=8, context_len=16,
                         num_threads=1, bandwidth_bytes=1 << 20, repeats=1)  # fmt: skip
    for value in (lim.train_tokens_per_s_limit, lim.decode_tokens_per_s_limit,
                  lim.copy_bytes_per_s, lim.triad_bytes_per_s, *lim.op_overhead_s.values()):  # fmt: skip
        assert math.isfinite(value) and value > 0
    assert lim.train.step_s == pytest.approx(lim.train.gemm_s + lim.train.optimizer_s)
    assert lim.decode.step_s == max(lim.decode.gemm_s, lim.decode.memory_s)
    assert lim.optimizer["num_params"] == mf.num_params(TINY)
    assert {"train", "decode"} == set(lim.gemms)
    json.dumps(lim.to_dict())  # what the benchmarks embed in their JSON
    only = measure_limits(TINY, parts=("decode",), decode_batch=4, bandwidth_bytes=1 << 20,
                          repeats=1)  # fmt: skip
    with pytest.raises(ValueError, match="without the train part"):
        _ = only.train_tokens_per_s_limit


def test_cli_writes_json_with_provenance(tmp_path) -> None:
    from slipstream.cli import main

    out = tmp_path / "limits.json"
    overrides = ["--model.hidden_size=32", "--model.num_hidden_layers=1",
                 "--model.num_attention_heads=2", "--model.num_key_value_heads=1",
                 "--model.head_dim=8", "--model.moe_intermediate_size=16",
                 "--model.num_experts=4"]  # fmt: skip
    assert main(["bench", "limits", "--bandwidth-mib", "1", "--dtypes", "float32", "--out",
                 str(out), *overrides]) == 0  # fmt: skip
    record = json.loads(out.read_text())
    (res,) = record["results"]
    assert res["model_config"]["hidden_size"] == 32 and res["model_config"]["vocab_size"] > 0
    assert res["train"]["tokens_per_s"] > 0 and res["decode"]["tokens_per_s"] > 0
    assert len(record["provenance"]["loadavg_start"]) == 3 and record["provenance"]["cpu_model"]
