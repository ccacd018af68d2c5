"""The tiny RL job the integration tests run: config overrides for a 1-layer MoE model, a saved
random start checkpoint, the job's command line, and its per-step metrics.
Importable from any test module (`pythonpath = ["tests"]` in pyproject)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import torch

from slipstream.config import SlipstreamConfig, load_config
from slipstream.model import MoEForCausalLM, hf_weights, load_pretrained, save_pretrained
from slipstream.storage import WeightStore
from slipstream.tasks import get_taskset

# A model that runs a job step in well under a second on one core.
TINY_MODEL = [
    "model.hidden_size=32", "model.num_hidden_layers=1", "model.num_attention_heads=2",
    "model.num_key_value_heads=1", "model.head_dim=8", "model.intermediate_size=32",
    "model.moe_intermediate_size=16", "model.num_experts=4", "model.max_position_embeddings=64",
    "engine.max_seq_len=64", "engine.max_new_tokens=8", "eval.num_prompts=4", "run.num_threads=1",
    "task.num_heldout=4",
]  # fmt: skip


# A few seconds of `slipstream sft` (60 steps) that learns something: CLI flags.
TINY_SFT = [
    "--model.hidden_size=32", "--model.num_hidden_layers=2", "--model.num_attention_heads=2",
    "--model.num_key_value_heads=1", "--model.head_dim=16", "--model.moe_intermediate_size=32",
    "--model.intermediate_size=64", "--model.num_experts=4", "--model.num_experts_per_tok=2",
    "--model.max_position_embeddings=32", "--task.max_digits=2", "--task.num_heldout=64",
    "--sft.batch_size=32", "--sft.lr=0.01", "--sft.warmup_steps=2", "--sft.log_every=20",
    "--eval.num_prompts=64", "--run.num_threads=1",
]  # fmt: skip


def save_random_init(directory: Path, overrides: list[str]) -> None:
    """A random (seed 0) model for the config `overrides` describe, saved as a start checkpoint."""
    _save_random(load_config(None, overrides), directory)


def publish_random_init(cfg: SlipstreamConfig, directory: Path) -> None:
    """A random (seed 0) model for `cfg` saved in `directory` and published as version 0 in
    cfg.store.url: what a rollout worker built from `cfg` waits for and loads."""
    _save_random(cfg, directory)
    WeightStore(cfg.store.url).publish(0, *hf_weights(load_pretrained(directory)))


def _save_random(cfg: SlipstreamConfig, directory: Path) -> None:
    vocab = get_taskset(cfg.task).tokenizer.vocab_size
    torch.manual_seed(0)
    save_pretrained(MoEForCausalLM(cfg.model.model_copy(update={"vocab_size": vocab})), directory)


def job_cmd(tmp: Path, output_dir: Path, overrides: list[str]) -> list[str]:
    """`slipstream run --plain` (the installed entry point, as a user types it) on built-in
    defaults + overrides, starting from tmp/init (see save_random_init)."""
    (tmp / "empty.toml").write_text("")
    slipstream = str(Path(sys.executable).parent / "slipstream")
    return [slipstream, "run", "--plain", "-c", str(tmp / "empty.toml"),
            f"--run.output_dir={output_dir}", f"--model.init_from={tmp / 'init'}",
            *(f"--{o}" for o in overrides)]  # fmt: skip


def trained_steps(metrics: Path) -> dict[int, dict]:
    """step -> its metrics record; a resumed run re-logs steps after its checkpoint: the last wins."""
    if not metrics.exists():
        return {}
    recs = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in recs if "loss" in r}


def start_server(
    tmp: Path, model_dir: Path, extra: Sequence[str] = ()
) -> tuple[subprocess.Popen, str]:
    """`slipstream serve --model model_dir` (TINY_MODEL engine sizes, then the `extra` dotted
    overrides) as a subprocess on a free loopback port, logging to tmp/server.log; -> (process,
    base URL). Not waited for: a rollout worker on engine.type = http waits for its /health.
    The caller terminates it."""
    from s3util import free_port

    (tmp / "empty.toml").write_text("")
    port = free_port()  # the server binds it a moment later
    with open(tmp / "server.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from slipstream.cli import main; raise SystemExit(main())",
             "serve", "--model", str(model_dir), "--port", str(port),
             "-c", str(tmp / "empty.toml"), *(f"--{o}" for o in (*TINY_MODEL, *extra))],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout_s: float = 180) -> None:
    """Until `url`/health answers 200 (AssertionError with the log's tail if the process
    exits or `timeout_s` passes)."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{url} did not come up: {log.read_text()[-2000:]}"
        time.sleep(0.1)
