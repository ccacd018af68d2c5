"""The RL loop with real processes: rollout workers killed with SIGKILL again and again lose no
task and train none twice; no trained token is older than max_staleness; SIGTERM drains a worker
(exit 0, unfinished tasks nacked, finished groups acked); a worker that cannot start fails the
job; workers roll out through a served engine (engine.type = http)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from jobutil import TINY_MODEL, save_random_init, start_server
from slipstream.config import SlipstreamConfig, load_config
from slipstream.launch.local import LocalLauncher
from slipstream.model import hf_weights
from slipstream.rl.buffer import ExperienceBuffer
from slipstream.rl.controller import Controller
from slipstream.rl.coordinator import Coordinator
from slipstream.rl.queue import TaskQueue
from slipstream.rl.types import RolloutFailed
from slipstream.storage import WeightStore


def tiny_config(tmp: Path, *overrides: str) -> SlipstreamConfig:
    cfg = load_config(None, [f"run.output_dir={tmp}/run", *TINY_MODEL, *overrides])
    init = tmp / "init"
    if not (init / "config.json").exists():
        save_random_init(init, [*TINY_MODEL, *overrides])
    cfg.model.init_from = str(init)
    return cfg


class TrainedBatches:
    """Wraps the controller's trainer.step: asserts no trained token is older than max_staleness
    and records the task ids and per-token versions of every trained batch."""

    def __init__(self, controller: Controller, max_staleness: int) -> None:
        self.task_ids: list[int] = []
        self.token_versions: list[int] = []
        real_step = controller.trainer.step

        def checked_step(batch):
            for s in batch.samples:
                lag = batch.trainer_version - min(s.versions)
                assert lag <= max_staleness, (batch.trainer_version, s.versions)
                self.token_versions.extend(s.versions)
            self.task_ids.extend(batch.task_ids)
            return real_step(batch)

        controller.trainer.step = checked_step  # type: ignore[method-assign]


def test_kill9_workers_nothing_lost_and_staleness_holds(tmp_path: Path) -> None:
    max_staleness = 1
    cfg = tiny_config(
        tmp_path, "trainer.mode=async", f"buffer.max_staleness={max_staleness}", "trainer.steps=30",
        "trainer.groups_per_step=2", "rollout.group_size=2", "rollout.num_workers=2",
        "rollout.tasks_per_lease=2", "rollout.max_inflight_tasks=2", "rollout.lease_ttl_s=1.5",
        "rollout.partial_rollouts=true", "rollout.verify_latency=lognormal",
        "rollout.verify_latency_p50_s=0.15", "trainer.checkpoint_every=0", "trainer.lr=0.01",
    )  # fmt: skip
    controller = Controller(cfg, cfg.model.init_from, evaluate=False)
    trained = TrainedBatches(controller, max_staleness).task_ids
    launcher = LocalLauncher(cfg, controller.coord)
    launcher.start()
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(r=controller.run()))
    runner.start()
    kills, last_kill_step = 0, 0
    try:
        while runner.is_alive() and kills < 4:
            time.sleep(0.1)
            if len(trained) // 2 < last_kill_step + 3:
                continue
            holders = controller.coord.queue.lease_holders()
            if not holders:
                continue
            # worker ids are "w<index>.<generation>": kill the process that holds a lease now
            index = int(next(iter(holders)).split(".")[0][1:])
            proc = launcher.procs[index]
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                kills += 1
                last_kill_step = len(trained) // 2
        runner.join(timeout=240)
    finally:
        launcher.stop()
    assert "r" in result and result["r"].steps == 30
    # the supervisor replaced the killed workers (the last kill may land as the run ends)
    assert kills >= 2 and launcher.num_restarts >= kills - 1
    assert len(trained) == len(set(trained)), "a task was trained twice"
    snap = controller.coord.snapshot()
    buffered = [g["task"]["task_id"] for g in snap["buffer"]["groups"]]
    issued = set(range(snap["queue"]["next_task_id"]))
    accounted = set(trained) | set(buffered) | set(snap["queue"]["pending"])
    assert not set(trained) & set(buffered)
    assert accounted == issued, f"lost tasks: {sorted(issued - accounted)}"
    assert controller.coord.queue.stats().num_expired_leases >= 1  # the kills did cost leases


def test_sigterm_drains_worker(tmp_path: Path) -> None:
    cfg = tiny_config(
        tmp_path, "rollout.num_workers=1", "rollout.group_size=2", "rollout.tasks_per_lease=4",
        "rollout.max_inflight_tasks=4", "rollout.lease_ttl_s=120", "rollout.drain_timeout_s=0.3",
        "rollout.verify_latency=lognormal", "rollout.verify_latency_p50_s=0.4",
        "trainer.groups_per_step=8", "buffer.max_staleness=4",
    )  # fmt: skip
    from slipstream.model import load_pretrained

    store = WeightStore(cfg.store.url)
    store.publish(0, *hf_weights(load_pretrained(cfg.model.init_from)))
    coord = Coordinator(TaskQueue(cfg.task.num_train), ExperienceBuffer(8, 4))
    launcher = LocalLauncher(cfg, coord, restart=False)
    launcher.start()
    try:
        deadline = time.monotonic() + 120
        while coord.queue.stats().num_done < 2:
            assert time.monotonic() < deadline, "worker produced nothing"
            time.sleep(0.05)
        proc = launcher.procs[0]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        launcher.stop()
    stats = coord.queue.stats()
    assert stats.num_leased == 0, "unfinished tasks were not nacked"
    assert stats.num_expired_leases == 0  # nothing came back by expiry: all by nack/ack
    assert stats.num_done == len(coord.buffer) >= 2
    snap = coord.queue.snapshot()
    assert set(snap["pending"]) | set(snap["done"]) == set(range(snap["next_task_id"]))


def test_worker_that_cannot_start_fails_the_job_with_its_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node with a broken image: the worker process dies on import, every time. The job fails
    after rollout.max_start_failures tries, with the worker's error, not after the batch timeout."""
    cfg = tiny_config(
        tmp_path, "rollout.num_workers=1", "rollout.max_start_failures=3",
        "rollout.restart_backoff_s=0.2", "trainer.batch_timeout_s=600", "trainer.steps=2",
        "trainer.checkpoint_every=0",
    )  # fmt: skip
    broken = tmp_path / "broken-image" / "torch"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('torch is missing (simulated image)')\n")
    monkeypatch.setenv("PYTHONPATH", str(broken.parent))  # reaches the worker processes only
    controller = Controller(cfg, cfg.model.init_from, evaluate=False)
    launcher = LocalLauncher(cfg, controller.coord)
    launcher.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(RolloutFailed, match="slot 0 failed to start 3 times in a row") as err:
            controller.run()
    finally:
        codes = launcher.stop()
    assert time.monotonic() - t0 < 120  # backoff 0.2 + 0.4 s plus three interpreter starts
    assert "torch is missing (simulated image)" in str(err.value)
    assert launcher.num_restarts == 2 and codes == {0: 1}
    assert len(list((tmp_path / "run" / "launch" / "logs").glob("w0.*.log"))) == 3


def test_dynamic_sampling_on_a_random_init_trains_every_step(tmp_path: Path) -> None:
    """A random start gets (nearly) every reward wrong, so (nearly) every group is uniform:
    unbounded dynamic sampling would drop them all and the trainer would wait out its batch
    timeout. The refill bound (buffer.min_signal_share) sees the share of groups with signal
    below 10% and trains the uniform groups instead: every step runs."""
    cfg = tiny_config(
        tmp_path, "rollout.num_workers=1", "rollout.group_size=4", "trainer.groups_per_step=4",
        "trainer.steps=6", "trainer.checkpoint_every=0", "trainer.batch_timeout_s=60",
        "buffer.dynamic_sampling=true", "buffer.signal_window_groups=8",
    )  # fmt: skip
    controller = Controller(cfg, cfg.model.init_from, evaluate=False)
    launcher = LocalLauncher(cfg, controller.coord)
    launcher.start()
    try:
        result = controller.run()
    finally:
        launcher.stop()
    assert result.steps == 6
    recs = {r["step"]: r for r in result.records if "loss" in r}  # what metrics.jsonl holds
    assert sorted(recs) == list(range(1, 7))
    last = recs[6]
    assert last["kept_uniform"] > 0 and last["signal_share"] is not None, last


@pytest.mark.parametrize("store", ["local", "s3+stage"])
def test_workers_roll_out_through_a_served_engine(
    tmp_path: Path, store: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """engine.type = http: the rollout worker is a client of `slipstream serve` (a separate process
    on loopback), pushes every published version to it by location, and trains on its samples.
    `s3+stage`: the store is on S3 (moto), which the server cannot read; the worker copies each
    version into engine.weights_stage_dir and gives the server that path."""
    store_args: list[str] = []
    if store == "s3+stage":
        from s3util import make_bucket

        moto_port = request.getfixturevalue("moto")
        make_bucket(moto_port)
        for key, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                           ("AWS_DEFAULT_REGION", "us-west-2")):  # fmt: skip
            monkeypatch.setenv(key, value)  # the trainer here and its worker processes
        store_args = ["store.url=s3://bucket/served", f"store.endpoint_url=http://127.0.0.1:{moto_port}",
                      f"engine.weights_stage_dir={tmp_path / 'stage'}"]  # fmt: skip
    save_random_init(tmp_path / "init", TINY_MODEL)
    server, url = start_server(tmp_path, tmp_path / "init")
    try:  # no wait for the server here: the worker waits for its /health (engine.server_wait_s)
        cfg = tiny_config(
            tmp_path, "engine.type=http", f"engine.url={url}", "engine.server_wait_s=60",
            "trainer.mode=async",
            "buffer.max_staleness=1", "trainer.steps=6", "trainer.groups_per_step=2",
            "rollout.group_size=2", "trainer.checkpoint_every=0", "trainer.lr=0.01",
            "trainer.skip_no_signal=false", *store_args,
        )  # fmt: skip
        controller = Controller(cfg, cfg.model.init_from, evaluate=False)
        token_versions = TrainedBatches(controller, max_staleness=1).token_versions
        launcher = LocalLauncher(cfg, controller.coord)
        launcher.start()
        try:
            result = controller.run()
        finally:
            codes = launcher.stop()
        assert result.steps == 6 and codes == {0: 0}
        assert min(token_versions) >= 0  # the server reported which weights made every token
        # ... and it followed the trainer: step 6 trains at version 5, so with staleness 1 its
        # tokens came from version 4 or later
        assert max(token_versions) >= 4
        info = httpx.get(f"{url}/get_model_info", timeout=5).json()
        assert int(info["weight_version"]) >= max(token_versions), info
        assert launcher.num_restarts == 0
        if store == "s3+stage":  # only the version the server holds stays staged, per slot
            assert [p.name for p in (tmp_path / "stage").iterdir()] == ["w0"]
            staged = [p.name for p in (tmp_path / "stage" / "w0").iterdir()]
            assert staged == [f"v{int(info['weight_version']):08d}"], staged
            assert not (tmp_path / "run" / "store").exists()
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    pytest.main([__file__, "-v"])
