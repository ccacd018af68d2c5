"""`slipstream rm train` on a learnable preference (chosen answers are correct sums, rejected
ones off by one): held-out pairwise accuracy rises well above chance, the checkpoint is complete
and the report names what it measured; bad pairs files fail naming the file and line."""

import json
import random

import pytest

from slipstream.cli import main
from slipstream.config import load_config
from slipstream.rm.model import SUMMARY_FILE, is_reward_checkpoint
from slipstream.rm.pairs import read_pairs
from slipstream.rm.train import split_pairs, train_reward_model

TINY = [
    "--model.hidden_size=32", "--model.num_hidden_layers=2", "--model.num_attention_heads=4",
    "--model.num_key_value_heads=2", "--model.head_dim=8", "--model.moe_intermediate_size=32",
    "--model.num_experts=4", "--model.num_experts_per_tok=2", "--model.max_position_embeddings=32",
    "--run.num_threads=1",
]  # fmt: skip


def _pairs(path, n=400):
    rng = random.Random(0)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        wrong = (a + b + rng.choice([1, 2, 3])) % 19
        rows.append({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(wrong)})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_rm_train_learns_and_saves(tmp_path):
    _pairs(tmp_path / "pairs.jsonl")
    cfg = load_config(None, [f"--run.output_dir={tmp_path}/run", f"--rm.pairs={tmp_path}/pairs.jsonl",
                             "--rm.steps=150", "--rm.batch_size=32", "--rm.lr=3e-3",
                             "--rm.heldout_fraction=0.2", *TINY])  # fmt: skip
    result = train_reward_model(cfg)
    assert result.heldout_pairs == 80 and result.train_pairs == 320
    assert result.heldout_accuracy >= 0.8, result
    ckpt = tmp_path / "run" / "rm" / "checkpoint"
    assert is_reward_checkpoint(ckpt)
    summary = json.loads((ckpt / SUMMARY_FILE).read_text())
    assert summary["heldout_accuracy"] == result.heldout_accuracy
    lines = [
        json.loads(x) for x in (tmp_path / "run" / "rm" / "metrics.jsonl").read_text().splitlines()
    ]
    assert lines[-1]["heldout_accuracy"] == result.heldout_accuracy


def test_split_keeps_heldout_out_of_training(tmp_path):
    _pairs(tmp_path / "p.jsonl", 50)
    pairs = read_pairs(tmp_path / "p.jsonl")
    train, held = split_pairs(pairs, 0.1, seed=3)
    assert len(held) == 5 and len(train) == 45
    assert sorted(map(repr, train + held)) == sorted(map(repr, pairs))


def test_bad_pairs_file_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n{"prompt": "x"}\n')
    with pytest.raises(
        ValueError, match=r"bad.jsonl:2: not a preference pair: no chosen, rejected"
    ):
        read_pairs(bad)


GOOD = '{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n'


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (GOOD.encode() + b'{"prompt": "x", "chosen": "2"}\n', ":2: not a preference pair: no rejected"),
        (GOOD.encode() + b'{"prompt": 1, "chosen": ["2"], "rejected": "3"}\n',
         ":2: prompt, chosen and rejected must be strings: prompt = 1 (int), chosen"),
        (GOOD.encode() + b'{"prompt": "x", "chosen": NaN, "rejected": "3"}\n',
         ":2: prompt, chosen and rejected must be strings: chosen = nan (float)"),
        (GOOD.encode() + b'["x", "2", "3"]\n', ":2: not a preference pair: a JSON object"),
        (GOOD.encode() + b'{"prompt": "x", \n', ":2: not JSON"),
        (b"", "no preference pairs (an empty file)"),
        (b"\n\n", "no preference pairs"),
        (GOOD.encode(), "1 pair; rm train needs at least 2"),
        (GOOD.encode() + b'{"prompt": "\xe9", "chosen": "2", "rejected": "3"}\n', ":2: not UTF-8 text"),
        (GOOD.encode() + b"[" * 100_000 + b"\n", ":2: JSON nested too deeply"),
    ],
    ids=["missing-field", "wrong-types", "nan", "not-an-object", "truncated", "empty", "blank",
         "one-pair", "non-utf8", "deep"],
)  # fmt: skip
def test_cli_rm_train_bad_pairs_are_one_line(body: bytes, why: str, tmp_path, capsys):
    """`slipstream rm train` on a pairs file it cannot use: rc 2 and one line naming the file
    (and line) and what is wrong, before any model is built; never a traceback."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_bytes(body)
    rc = main(["rm", "train", f"--run.output_dir={tmp_path}/run", f"--rm.pairs={pairs}", *TINY])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and "Traceback" not in err, err
    assert err.startswith(f"slipstream: {pairs}") and why in err, err
    assert not (tmp_path / "run" / "rm" / "checkpoint").exists()


def test_cli_rm_train_missing_pairs_is_one_line(tmp_path, capsys):
    rc = main(["rm", "train", f"--run.output_dir={tmp_path}", f"--rm.pairs={tmp_path}/none.jsonl"])
    assert rc != 0
    err = capsys.readouterr().err
    assert "none.jsonl" in err and "Traceback" not in err


def test_rm_config_bounds_name_the_key():
    from slipstream.config import ConfigError

    with pytest.raises(ConfigError, match="rm.label_noise"):
        load_config(None, ["--rm.label_noise=0.7"])
    with pytest.raises(ConfigError, match="reward.timeout_s"):
        load_config(None, ["--reward.timeout_s=0"])
    with pytest.raises(ConfigError, match="reward.source"):
        load_config(None, ["--reward.source=magic"])
