"""The reward model served by `slipstream serve` (a real process) in vLLM's /classify shape, and
the `reward_model` reward source of a real rollout worker against it: every acked group's rewards
are sigmoid(the model's score), the worker's completions are batched, and when the server is
killed no group is rewarded: the worker's tasks are requeued (nacked, not dropped) until a new
server answers, then groups flow again."""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from jobutil import TINY_MODEL, publish_random_init
from s3util import free_port
from slipstream.config import load_config
from slipstream.launch.worker import WorkerSpec, build_worker, close_worker
from slipstream.rewards.rewardset import RewardSet
from slipstream.rl.buffer import ExperienceBuffer
from slipstream.rl.coordinator import Coordinator
from slipstream.rl.queue import TaskQueue
from slipstream.rm.model import MoERewardModel, load_reward_model, save_reward_model, score_ids
from slipstream.rm.source import RewardModelScorer, sigmoid
from slipstream.tasks import get_taskset

TINY = [*TINY_MODEL, "task.name=arithmetic"]


def _wait_until(cond, timeout_s: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert proc is None or proc.poll() is None, f"{what}: the server exited"
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.05)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def _serve(tmp: Path, model_dir: Path, port: int, name: str) -> subprocess.Popen:
    (tmp / "empty.toml").write_text("")
    with open(tmp / f"{name}.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from slipstream.cli import main; raise SystemExit(main())",
             "serve", "--model", str(model_dir), "--port", str(port),
             "-c", str(tmp / "empty.toml")],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    _wait_until(lambda: _healthy(f"http://127.0.0.1:{port}"), 60, "reward server /health", proc)
    return proc


@pytest.fixture
def rm_dir(tmp_path: Path) -> Path:
    cfg = load_config(None, TINY)
    tok = get_taskset(cfg.task).tokenizer
    torch.manual_seed(0)
    rm = MoERewardModel(cfg.model.model_copy(update={"vocab_size": tok.vocab_size})).eval()
    return save_reward_model(rm, tmp_path / "rm", tok)


def test_classify_endpoint_scores_as_the_model(tmp_path: Path, rm_dir: Path) -> None:
    port = free_port()
    proc = _serve(tmp_path, rm_dir, port, "server")
    url = f"http://127.0.0.1:{port}"
    try:
        texts = ["12+34=46", "7-9=-2", "1+1=3"]
        r = httpx.post(url + "/v1/classify", json={"model": "rm", "input": texts}, timeout=30)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and body["id"].startswith("classify-")
        rm = load_reward_model(rm_dir)
        tok = get_taskset(load_config(None, TINY).task).tokenizer
        ours = score_ids(rm, [tok.encode_prompt(t) for t in texts], tok.pad_id)
        for d, x in zip(body["data"], ours, strict=True):
            assert d["num_classes"] == 1 and d["label"] == "LABEL_0"
            assert abs(d["logits"][0] - x) <= 1e-5 and abs(d["probs"][0] - sigmoid(x)) <= 1e-6
        assert body["usage"]["prompt_tokens"] == sum(len(t) + 1 for t in texts)
        one = httpx.post(url + "/classify", json={"input": [tok.encode_prompt(texts[0])]}).json()
        assert abs(one["data"][0]["logits"][0] - ours[0]) <= 1e-5  # token ids in, same score
        bad = httpx.post(url + "/classify", json={"input": [[1, 10_000]]})
        assert bad.status_code == 400 and "outside" in bad.json()["error"]["message"]
        bad = httpx.post(url + "/classify", json={"input": []})
        assert bad.status_code == 400 and bad.json()["error"]["message"] == "input is empty"
        # docs/rlhf.md: an empty input is a 400, never the score of BOS alone
        for empty, where in (("", 0), (["12+34=46", ""], 1), (["  "], 0), ([[]], 0)):
            bad = httpx.post(url + "/classify", json={"input": empty})
            assert bad.status_code == 400, (empty, bad.text)
            assert bad.json()["error"]["message"] == f"input[{where}] is empty"
    finally:
        proc.kill()
        proc.wait()


def test_worker_rewards_from_served_rm_and_requeues_when_it_dies(
    tmp_path: Path, rm_dir: Path
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(tmp_path, rm_dir, port, "server1")
    cfg = load_config(None, [
        f"run.output_dir={tmp_path}/run", *TINY, "rollout.group_size=4",
        "rollout.tasks_per_lease=2", "rollout.max_inflight_tasks=4", "rollout.lease_ttl_s=60",
        "rollout.verify_threads=8", "rollout.drain_timeout_s=5", "reward.source=reward_model",
        f"reward.url={url}", "reward.timeout_s=5", "reward.batch_window_s=0.02",
    ])  # fmt: skip
    publish_random_init(cfg, tmp_path / "init")
    coord = Coordinator(TaskQueue(cfg.task.num_train), ExperienceBuffer(10_000, 10_000))
    worker = build_worker(WorkerSpec(("127.0.0.1", 0), b"\0", cfg.model_dump(mode="json")),
                          "w0.0", coord=coord)  # fmt: skip
    assert isinstance(worker.verifier, RewardSet)
    rm = worker.verifier.local["reward_model"]
    assert isinstance(rm, RewardModelScorer)
    scorer = rm.scorer
    runner = threading.Thread(target=worker.run, name="worker")
    proc2 = None
    try:
        runner.start()
        _wait_until(lambda: coord.queue.stats().num_done >= 4, 120, "groups with RM rewards")
        assert scorer.calls < scorer.texts  # completions of several episodes per call
        proc.kill()  # the reward model goes away mid-run
        proc.wait()
        done_at_kill = coord.queue.stats().num_done
        _wait_until(lambda: worker.stats["tasks_nacked"] >= 4, 60, "tasks requeued")
        assert worker.stats["tasks_dropped"] == 0 and worker.stats["infra_failures"] >= 4
        # at most the groups already scored when it died were acked after
        assert coord.queue.stats().num_done <= done_at_kill + cfg.rollout.max_inflight_tasks
        proc2 = _serve(tmp_path, rm_dir, port, "server2")  # a new server on the same address
        resumed = coord.queue.stats().num_done
        _wait_until(lambda: coord.queue.stats().num_done >= resumed + 2, 120, "groups again")
    finally:
        worker.request_stop()
        runner.join(timeout=60)
        close_worker(worker)
        for p in (proc, proc2):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    assert not runner.is_alive()
    # every trained group's reward is the model's, never a made-up one for a failure
    rm = load_reward_model(rm_dir)
    taskset = get_taskset(cfg.task)
    tok = taskset.tokenizer
    groups = coord.snapshot()["buffer"]["groups"]
    assert len(groups) >= 6
    for g in groups:
        prompt = taskset.train(g["task"]["index"]).prompt
        texts = [prompt + s["text"] for s in g["samples"]]
        want = score_ids(rm, [tok.encode_prompt(t) for t in texts], tok.pad_id)
        for s, w in zip(g["samples"], want, strict=True):
            assert math.isclose(s["reward"], sigmoid(w), abs_tol=1e-5), (s, w)


def test_bench_rm_reports_figure_baseline_and_limit(tmp_path: Path, rm_dir: Path) -> None:
    import json

    from slipstream.cli import main

    out = tmp_path / "rm.json"
    overrides = [f"--{o}" for o in TINY]
    rc = main(["bench", "rm", "--model", str(rm_dir), "--num", "48", "--concurrency", "8",
               "--max-batch", "16", "--out", str(out), *overrides])  # fmt: skip
    assert rc == 0
    rec = json.loads(out.read_text())
    assert rec["benchmark"] == "rm" and rec["num"] == 48
    for key in ("figure", "baseline", "limit"):
        assert rec[key]["value"] > 0
    assert rec["served"]["calls"] < 48  # the served texts were batched
    assert rec["provenance"]["cpu_model"] is not None or rec["provenance"]["nproc"] > 0
