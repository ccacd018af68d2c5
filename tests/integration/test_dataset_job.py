"""`task.name = "dataset"` in real jobs: the README's example config (examples/own_data.toml) with
all six example files (TRL, verl, OpenRLHF layouts; JSONL and Parquet) plus one on s3:// (a moto
server) trains SFT then GRPO with the example's Python reward functions; and kill -9 mid-dataset
resumes the same order of prompts."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jobutil import TINY_MODEL, trained_steps

ROOT = Path(__file__).resolve().parents[2]


def make_data(out: Path, n: int = 200) -> list[Path]:
    spec = importlib.util.spec_from_file_location("make_data", ROOT / "examples" / "make_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.write(out, n=n)


@pytest.mark.slow
def test_own_data_example_trains_from_local_and_s3_files(tmp_path: Path, moto: int) -> None:
    import s3fs

    from s3util import s3_options

    files = make_data(tmp_path / "data")
    fs = s3fs.S3FileSystem(**s3_options(moto))
    fs.mkdir("bucket")
    fs.put(str(tmp_path / "data" / "verl.jsonl"), "bucket/data/verl-0.jsonl")
    sources = [str(f) for f in files] + ["s3://bucket/data/verl-*.jsonl"]
    out = tmp_path / "run"
    cmd = [
        str(Path(sys.executable).parent / "slipstream"), "run", "--plain",
        "-c", str(ROOT / "examples" / "own_data.toml"), f"--run.output_dir={out}",
        *(f"--{o}" for o in TINY_MODEL), f"--task.train_files={json.dumps(sources)}",
        f"--task.data_endpoint_url=http://127.0.0.1:{moto}", "--task.num_heldout=8",
        "--eval.num_prompts=8", "--sft.steps=4", "--sft.batch_size=16", "--sft.log_every=2",
        "--trainer.steps=2", "--trainer.groups_per_step=2", "--rollout.group_size=2",
        "--trainer.eval_every=0", "--trainer.checkpoint_every=0", "--trainer.skip_no_signal=false",
        "--reward.workers=1",
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT), AWS_ACCESS_KEY_ID="testing",
               AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-west-2")  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sft = [json.loads(x) for x in (out / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in sft if "loss" in r] == [2, 4]
    steps = trained_steps(out / "metrics.jsonl")
    assert sorted(steps) == [1, 2]
    record = steps[2]
    # Every sample's reference reached the Python function through its layout's column (answer,
    # reward_model, label): a missing column would have made it None.
    assert record["reward/correct/none"] == 0.0 and "reward/format/mean" in record, record


@pytest.mark.slow
def test_kill9_mid_dataset_resumes_the_same_prompts(tmp_path: Path) -> None:
    """test_rl_resume's kill -9 at a random step, on a dataset: the resumed run trains the same
    task ids with the same losses per step as the uninterrupted one, and task id i is train(i),
    a pure function of (task.seed, i) (tests/unit/test_dataset.py), so the prompts continue in
    the same order. Small blocks and window so the run crosses several of them."""
    from test_rl_resume import kill_and_resume

    files = make_data(tmp_path / "data", n=120)
    sources = json.dumps([str(f) for f in files if f.suffix == ".parquet"])
    kill_and_resume(tmp_path, store=["task.name=dataset", f"task.train_files={sources}",
                                     "task.block_rows=4", "task.shuffle_buffer=16"], env={})  # fmt: skip
