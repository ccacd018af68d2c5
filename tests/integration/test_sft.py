"""SFT -> checkpoint -> eval through the real CLI, on a tiny config (a few seconds on 2 cores)."""

from __future__ import annotations

import json

import pytest

from slipstream.cli import main
from slipstream.model.tokenizer import CharTokenizer, load_tokenizer
from slipstream.observe.metrics import read_metrics
from slipstream.sft import checkpoint_complete

TINY = [
    "--model.hidden_size=32",
    "--model.num_hidden_layers=2",
    "--model.num_attention_heads=2",
    "--model.num_key_value_heads=1",
    "--model.head_dim=16",
    "--model.moe_intermediate_size=32",
    "--model.intermediate_size=64",
    "--model.num_experts=4",
    "--model.num_experts_per_tok=2",
    "--task.max_digits=2",
    "--task.num_heldout=16",
    "--sft.batch_size=16",
    "--sft.warmup_steps=2",
    "--sft.log_every=2",
    "--eval.num_prompts=16",
    "--eval.k=2",
    "--eval.num_samples=3",
    "--eval.max_new_tokens=6",
    "--run.num_threads=1",
]


def test_sft_then_eval_via_cli(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    args = [f"--run.output_dir={out}", *TINY]
    assert main(["sft", *args, "--sft.steps=6"]) == 0
    ckpt = out / "sft" / "checkpoint"
    for name in ["config.json", "model.safetensors", "tokenizer.json", "sft_summary.json"]:
        assert (ckpt / name).is_file(), name
    records = read_metrics(out / "sft" / "metrics.jsonl")
    assert [r["step"] for r in records] == [2, 4, 6]
    assert all(r["loss"] > 0 and r["tokens_per_s"] > 0 for r in records)
    assert isinstance(load_tokenizer(ckpt), CharTokenizer)
    hf_config = json.loads((ckpt / "config.json").read_text())
    assert hf_config["vocab_size"] == CharTokenizer().vocab_size
    assert hf_config["num_experts"] == 4

    capsys.readouterr()
    assert main(["eval", *args, "--checkpoint", str(ckpt)]) == 0
    printed = capsys.readouterr().out
    assert "pass@1 (greedy)" in printed and "pass@2 (n=3)" in printed
    result = json.loads((out / "eval" / "results.json").read_text())
    report = result["report"]
    assert report["num_prompts"] == 16 and report["k"] == 2 and report["num_samples"] == 3
    for key in ["pass_at_1_greedy", "pass_at_1_sampled", "pass_at_k"]:
        assert 0.0 <= report[key] <= 1.0
    assert report["pass_at_k"] >= report["pass_at_1_sampled"]
    assert len(result["samples"]) == 16 and sum(report["greedy_reasons"].values()) == 16

    # The RL main job (`slipstream run`) skips SFT exactly when this says the checkpoint is complete.
    assert checkpoint_complete(ckpt)
    (ckpt / "sft_summary.json").unlink()
    assert not checkpoint_complete(ckpt)


def test_sft_learns_a_single_answer(tmp_path) -> None:
    """Loss must fall: a real training loop, not a no-op that writes files."""
    out = tmp_path / "run"
    args = [
        f"--run.output_dir={out}",
        *TINY,
        "--sft.steps=30",
        "--sft.lr=1e-2",
        "--sft.log_every=5",
    ]
    assert main(["sft", *args]) == 0
    losses = [r["loss"] for r in read_metrics(out / "sft" / "metrics.jsonl")]
    assert losses[-1] < 0.75 * losses[0], losses


def test_sft_extends_until_the_validation_band(tmp_path) -> None:
    """sft.min_pass_at_1: checks on held-out tasks past the reported ones after `steps`, then
    every extend_steps; stops at the target, or after max_extend_rounds and says so."""
    out = tmp_path / "run"
    base = [f"--run.output_dir={out}", *TINY, "--task.num_heldout=32", "--sft.steps=4",
            "--sft.extend_steps=2", "--sft.val_prompts=16"]  # fmt: skip
    # unreachable: every round runs, the summary records each check
    assert main(["sft", *base, "--sft.min_pass_at_1=1.0", "--sft.max_extend_rounds=2"]) == 0
    summary = json.loads((out / "sft" / "checkpoint" / "sft_summary.json").read_text())["result"]
    assert summary["steps"] == 8
    assert [v["step"] for v in summary["validation"]] == [4, 6, 8]
    assert all(0.0 <= v["val_pass_at_1"] < 1.0 for v in summary["validation"])
    checks = [r for r in read_metrics(out / "sft" / "metrics.jsonl") if "val_pass_at_1" in r]
    assert [r["step"] for r in checks] == [4, 6, 8]
    # max_extend_rounds = 0: one check and no extra step, whatever it reads
    out2 = tmp_path / "run2"
    args2 = [
        a if not a.startswith("--run.output_dir") else f"--run.output_dir={out2}" for a in base
    ]
    assert main(["sft", *args2, "--sft.min_pass_at_1=1.0", "--sft.max_extend_rounds=0"]) == 0
    summary2 = json.loads((out2 / "sft" / "checkpoint" / "sft_summary.json").read_text())["result"]
    assert summary2["steps"] == 4 and len(summary2["validation"]) == 1


def test_validation_band_needs_held_out_tasks_past_the_reported_ones(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    assert main(["sft", f"--run.output_dir={out}", *TINY, "--sft.min_pass_at_1=0.5"]) == 2
    err = capsys.readouterr().err
    assert "task.num_heldout" in err and "sft.val_prompts" in err
    assert not out.exists()


def test_bad_config_fails_before_work(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    assert main(["sft", f"--run.output_dir={out}", "--sft.steps=-1"]) == 2
    assert "sft.steps" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    "n,c,k,expected", [(8, 0, 8, 0.0), (8, 1, 8, 1.0), (4, 2, 1, 0.5), (5, 1, 2, 0.4)]
)
def test_pass_at_k_estimator(n, c, k, expected) -> None:
    from slipstream.evaluate import pass_at_k

    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_batched_cached_greedy_decode_matches_naive_loop() -> None:
    """decode() (the rollout engine, greedy) == a full-forward argmax loop per prompt."""
    import torch

    from slipstream.config.model import ModelConfig
    from slipstream.evaluate import decode
    from slipstream.model import MoEForCausalLM

    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=20,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=4,
    )
    model = MoEForCausalLM(cfg).eval()
    prompts = [[1, 5, 6], [1, 7], [1, 5, 6, 9, 9], [1, 8], [1, 3, 4]]
    eos = 2
    got = decode(model, prompts, max_new_tokens=6, eos_id=eos, max_batch_size=2)
    for prompt, completion in zip(prompts, got, strict=True):
        seq = list(prompt)
        expected: list[int] = []
        with torch.no_grad():
            for _ in range(6):
                nxt = int(model(torch.tensor([seq])).logits_BTV[0, -1].argmax())
                if nxt == eos:
                    break
                expected.append(nxt)
                seq.append(nxt)
        assert completion == expected


def test_sft_chunked_loss_equals_full_logits(tmp_path) -> None:
    """sft.logits_chunk_tokens: the chunked LM head + cross-entropy trains like the full logits
    (model/lm_loss.py): the same logged losses within 1e-5 over 6 steps."""
    losses = {}
    for chunk in (0, 7):
        out = tmp_path / f"chunk{chunk}"
        args = [f"--run.output_dir={out}", *TINY, "--sft.steps=6", "--sft.log_every=1",
                f"--sft.logits_chunk_tokens={chunk}"]  # fmt: skip
        assert main(["sft", *args]) == 0
        losses[chunk] = [r["loss"] for r in read_metrics(out / "sft" / "metrics.jsonl")]
    assert len(losses[0]) == 6
    assert losses[7] == pytest.approx(losses[0], rel=1e-5)
