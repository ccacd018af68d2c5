"""`bench train` end to end on a tiny model (real Trainer.step and run_sft, a profile of one
step each): the JSON carries figure, limit, fraction and the profile summary; no timing is
asserted. And the profile folding on names."""

from __future__ import annotations

import json

import pytest

from slipstream.bench.profile_summary import category

TINY = ["--model.hidden_size=32", "--model.num_hidden_layers=1", "--model.num_attention_heads=2",
        "--model.num_key_value_heads=1", "--model.head_dim=8", "--model.moe_intermediate_size=16",
        "--model.num_experts=4", "--trainer.groups_per_step=2", "--rollout.group_size=2",
        "--sft.batch_size=4"]  # fmt: skip


def test_categories_of_op_names() -> None:
    assert category("aten::mm") == "matmul"
    assert category("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert category("aten::index_select") == "index/sort (routing, gather, scatter)"
    assert category("aten::_foreach_mul_") == "optimizer kernels"
    assert category("autograd::engine::evaluate_function: MmBackward0") == "autograd"
    assert category("Optimizer.step#AdamW.step") == "record_function self"
    assert category("aten::silu") == "elementwise"
    assert category("aten::made_up_op") == "other"


@pytest.mark.slow
def test_bench_train_reports_figure_limit_and_profile(tmp_path) -> None:
    from slipstream.cli import main

    out = tmp_path / "train.json"
    argv = ["bench", "train", "--models", "config", "--steps", "1", "--repeats", "2",
            "--warmup", "0", "--out", str(out), *TINY]  # fmt: skip
    assert main(argv) == 0
    record = json.loads(out.read_text())
    rows = {r["kind"]: r for r in record["results"]}
    assert set(rows) == {"rl", "sft"}
    for kind, r in rows.items():
        assert len(r["windows"]) == 2, kind
        assert r["tokens_per_s"]["min"] <= r["tokens_per_s"]["median"] <= r["tokens_per_s"]["max"]
        assert r["limit_tokens_per_s"] > 0 and r["fraction_of_limit"] > 0
        assert r["limit"]["train"]["num_tokens"] == round(r["tokens_per_step"])
        summary = r["profile_summary"]
        assert summary["num_top_level_ops"] > 0 and summary["self_s_by_phase"]["backward"] > 0
        assert summary["self_s_by_phase"]["optimizer"] > 0  # the whole step was profiled
        table = (tmp_path / f"train-profile-config-{kind}.txt").read_text()
        assert "aten::mm" in table and "Self CPU" in table
    # 2 groups x 2 samples of prompt + answer: padding is reported, positions counted exactly
    assert 0 <= rows["rl"]["padding_frac"] < 1
    assert record["provenance"]["loadavg_start"] and record["settings"]["steps"] == 1


@pytest.mark.slow
def test_bench_train_without_a_profile(tmp_path) -> None:
    """--profile-steps 0 times the windows and profiles nothing (it used to profile every RL
    batch, `batches[-0:]`, and then fail to combine an empty SFT profile list)."""
    from slipstream.cli import main

    out = tmp_path / "train.json"
    argv = ["bench", "train", "--models", "config", "--steps", "1", "--repeats", "1",
            "--warmup", "0", "--profile-steps", "0", "--out", str(out), *TINY]  # fmt: skip
    assert main(argv) == 0
    for r in json.loads(out.read_text())["results"]:
        assert r["profile_summary"] is None and r["profile_table"] is None
        assert len(r["windows"]) == 1 and r["fraction_of_limit"] > 0
    assert not list(tmp_path.glob("train-profile-*"))
    with pytest.raises(SystemExit):
        main(["bench", "train", "--profile-steps", "-1", "--out", str(out)])


def test_bench_train_preset_on_cpu(tmp_path) -> None:
    """`bench train --preset tiny`: the real Trainer.step at a preset shape, MFU against the
    matmul peak measured in the same run, and transformers' model on the same weights."""
    from slipstream.cli import main

    out = tmp_path / "preset.json"
    argv = ["bench", "train", "--preset", "tiny", "--batch", "2", "--seq-len", "32",
            "--steps", "2", "--warmup", "1", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    row = json.loads(out.read_text())["results"][0]
    assert row["preset"] == "tiny" and row["tokens_per_step"] == 64
    assert row["tokens_per_s"] > 0 and 0 < row["mfu"] < 1
    assert row["peak"]["peak_flops_per_s"] >= row["peak"]["square_gemm_flops_per_s"] > 0
    assert row["moe_fallbacks"] == []
    try:
        import transformers  # noqa: F401
    except ImportError:
        assert row["hf"]["tokens_per_s"] is None and "not installed" in row["hf"]["reason"]
    else:
        assert row["hf"]["tokens_per_s"] > 0 and row["vs_hf"] > 0
