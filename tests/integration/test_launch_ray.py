"""The job with `run.launcher=ray`: rollout workers are Ray actors on a private local Ray instance
(1 logical CPU per worker). The real job runs as a subprocess on a tiny random model; it must
finish all steps and train each task once, also when the worker actor's process is SIGKILLed
mid-run (the launcher replaces the dead actor)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from jobutil import TINY_MODEL, job_cmd, save_random_init, trained_steps
from slipstream.config import load_config

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ray = pytest.importorskip("ray")

TINY = [
    *TINY_MODEL, "trainer.mode=sync", "trainer.groups_per_step=2", "rollout.group_size=4",
    "rollout.num_workers=1", "trainer.lr=0.01", "rollout.lease_ttl_s=3",
    "rollout.drain_timeout_s=5", "trainer.skip_no_signal=false", "trainer.checkpoint_every=0",
    "run.launcher=ray",
]  # fmt: skip


def start_job(tmp: Path, *overrides: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    save_random_init(tmp / "init", TINY)
    cmd = job_cmd(tmp, tmp / "run", [*TINY, *overrides])
    env = dict(os.environ, OMP_NUM_THREADS="1", RAY_DISABLE_USAGE_STATS="1", **(env or {}))
    env.pop("RAY_ADDRESS", None)
    return subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=open(tmp / "job.err", "wb"))  # fmt: skip


def finish(job: subprocess.Popen, tmp: Path, timeout_s: float) -> dict[int, dict]:
    try:
        assert job.wait(timeout=timeout_s) == 0, (tmp / "job.err").read_text()[-3000:]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    out = trained_steps(tmp / "run" / "metrics.jsonl")
    trained = [t for s in sorted(out) for t in out[s]["task_ids"]]
    assert len(trained) == len(set(trained)), trained
    assert (tmp / "run" / "report.md").exists()
    return out


def test_job_with_ray_actors(tmp_path: Path) -> None:
    t0 = time.monotonic()
    out = finish(start_job(tmp_path, "trainer.steps=4"), tmp_path, timeout_s=120)
    assert sorted(out) == [1, 2, 3, 4]
    workers = (tmp_path / "run" / "launch" / "ray_workers.jsonl").read_text().splitlines()
    assert [json.loads(w)["worker_id"] for w in workers] == ["w0.0"]
    print(f"ray job: 4 steps in {time.monotonic() - t0:.1f} s (process wall)")


def test_trainer_ranks_as_actors_of_a_placement_group(tmp_path: Path) -> None:
    """trainer.num_processes = 2 with ep 2 under the Ray launcher: rank 1 is an actor of a
    placement group (run.ray_trainer_resources), joins rank 0 (the driver) over gloo, and the
    expert-parallel job trains and publishes like the local one."""
    out = finish(start_job(tmp_path, "trainer.steps=4", "trainer.num_processes=2",
                           "trainer.parallel.ep=2", "trainer.groups_per_step=2"),
                 tmp_path, timeout_s=180)  # fmt: skip
    assert sorted(out) == [1, 2, 3, 4]
    placed = json.loads((tmp_path / "run" / "launch" / "trainer_ranks.json").read_text())
    assert [p["rank"] for p in placed] == [1] and placed[0]["pid"] != os.getpid()
    report = (tmp_path / "run" / "report.md").read_text()
    assert "**trainer rank exit codes**: [0]" in report, report
    versions = sorted((tmp_path / "run" / "store" / "weights").iterdir())
    assert versions[-1].name == "v00000004"


def test_rank_order_keeps_a_nodes_ranks_together() -> None:
    from slipstream.launch.ray_ranks import rank_order

    # bundles 0..6 on nodes b, a, b, c, c, a, c; the driver (rank 0) is on a
    nodes = ["b", "a", "b", "c", "c", "a", "c"]
    order = rank_order("a", nodes, ranks_per_node=0)
    assert [nodes[i] for i in order] == ["a", "a", "b", "b", "c", "c", "c"]
    with pytest.raises(ValueError, match="ranks_per_node = 3"):
        rank_order("a", nodes, ranks_per_node=3)  # a holds 3 (driver + 2), b only 2
    assert len(rank_order("a", ["a", "a", "b", "b", "b"], ranks_per_node=3)) == 5


def test_killed_actor_is_replaced(tmp_path: Path) -> None:
    job = start_job(tmp_path, "trainer.steps=6")
    record = tmp_path / "run" / "launch" / "ray_workers.jsonl"
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    try:
        while not (record.exists() and max(trained_steps(metrics), default=0) >= 2):
            assert job.poll() is None, (tmp_path / "job.err").read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        os.kill(json.loads(record.read_text().splitlines()[0])["pid"], signal.SIGKILL)
    except BaseException:
        os.killpg(job.pid, signal.SIGKILL)
        raise
    out = finish(job, tmp_path, timeout_s=150)
    assert sorted(out) == list(range(1, 7))
    ids = [json.loads(w)["worker_id"] for w in record.read_text().splitlines()]
    assert ids[:2] == ["w0.0", "w0.1"], ids
    report = (tmp_path / "run" / "report.md").read_text()
    restarts = re.search(r"\*\*worker restarts\*\*: (\d+)", report)
    assert restarts and int(restarts.group(1)) >= 1, report


def test_two_node_cluster(tmp_path: Path, moto: int) -> None:
    """A cluster of 2 nodes (two raylets of ray.cluster_utils on this machine, 1 CPU each): the
    default store, a local path, is refused before any actor starts; with the store on s3:// (a
    moto server on loopback) the job runs one worker actor on each node."""
    from ray.cluster_utils import Cluster

    from s3util import make_bucket
    from slipstream.launch.ray import RayLauncher

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        cluster.add_node(num_cpus=1)
        address = f"run.ray_address={cluster.address}"
        cfg = load_config(None, [*TINY, f"run.output_dir={tmp_path}", address])
        launcher = RayLauncher(cfg, coordinator=None)
        with pytest.raises(RuntimeError, match="store.url to s3://"):
            launcher.start()
        assert launcher.actors == {}
        ray.shutdown()  # this process's driver; the cluster stays up

        make_bucket(moto)
        creds = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-west-2"}  # fmt: skip
        job = start_job(tmp_path, "trainer.steps=4", "rollout.num_workers=2", address,
                        "store.url=s3://bucket/run", f"store.endpoint_url=http://127.0.0.1:{moto}",
                        env=creds)  # fmt: skip
        out = finish(job, tmp_path, timeout_s=150)
        assert sorted(out) == [1, 2, 3, 4]
        assert not (tmp_path / "run" / "store").exists()
        report = (tmp_path / "run" / "report.md").read_text()
        assert "**worker exit codes**: {0: 0, 1: 0}" in report, report  # both drained
        record = (tmp_path / "run" / "launch" / "ray_workers.jsonl").read_text().splitlines()
        assert len({json.loads(w)["node_id"] for w in record}) == 2, record
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_actor_that_cannot_start_fails_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Worker actors on a node with a broken image (torch shadowed by a package that raises on
    import; the private Ray instance's workers inherit this process's environment): the launcher
    retries with backoff, then the trainer's wait ends with the actor's error."""
    from slipstream.launch.ray import RayLauncher
    from slipstream.rl.controller import Controller
    from slipstream.rl.types import RolloutFailed

    save_random_init(tmp_path / "init", TINY)
    cfg = load_config(None, [*TINY, f"run.output_dir={tmp_path}/run", "trainer.steps=2",
                             f"model.init_from={tmp_path / 'init'}", "rollout.max_start_failures=2",
                             "rollout.restart_backoff_s=0.2"])  # fmt: skip
    broken = tmp_path / "broken-image" / "torch"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('torch is missing (simulated image)')\n")
    monkeypatch.setenv("PYTHONPATH", str(broken.parent))
    monkeypatch.setenv("RAY_DISABLE_USAGE_STATS", "1")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    controller = Controller(cfg, cfg.model.init_from, evaluate=False)
    launcher = RayLauncher(cfg, controller.coord)
    launcher.start()
    try:
        with pytest.raises(RolloutFailed, match="slot 0 failed to start 2 times in a row") as err:
            controller.run()
    finally:
        launcher.stop()
    assert "torch is missing (simulated image)" in str(err.value)
    assert launcher.num_restarts == 1


def test_drain_file_drains_the_actor_and_keeps_new_ones_off_the_node(tmp_path: Path) -> None:
    """A Spot node being reclaimed (the preStop hook of deploy/kuberay/rayjob.yaml creates the
    drain file): the actor stops leasing and returns its unfinished tasks at once (leases live 300 s
    here, so waiting for expiry would stall the job); replacements refuse to start on the node
    while the file is there; once it is gone (the node replaced) the job finishes, every task once."""
    from slipstream.launch.ray import RayLauncher
    from slipstream.rl.controller import Controller

    drain = tmp_path / "drain"
    save_random_init(tmp_path / "init", TINY)
    cfg = load_config(None, [*TINY, f"run.output_dir={tmp_path}/run", "trainer.steps=12",
                             f"model.init_from={tmp_path / 'init'}", f"rollout.drain_file={drain}",
                             "rollout.lease_ttl_s=300", "rollout.restart_backoff_s=0.2"])  # fmt: skip
    os.environ.pop("RAY_ADDRESS", None)
    controller = Controller(cfg, cfg.model.init_from, evaluate=False)
    trained: list[int] = []
    real_step = controller.trainer.step

    def recorded_step(batch):
        trained.extend(batch.task_ids)
        return real_step(batch)

    controller.trainer.step = recorded_step  # type: ignore[method-assign]
    launcher = RayLauncher(cfg, controller.coord)
    launcher.start()
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(r=controller.run()))
    t0 = time.monotonic()
    runner.start()
    try:
        while controller.trainer.step_count < 2:
            assert runner.is_alive() and time.monotonic() - t0 < 120
            time.sleep(0.05)
        drain.touch()
        # the drained actor is replaced, and its replacements refuse to work on the node
        while launcher.num_restarts < 1 or launcher.num_drain_retries < 2:
            assert runner.is_alive() and time.monotonic() - t0 < 120
            time.sleep(0.05)
        held = controller.trainer.step_count
        time.sleep(1.0)
        # no worker while the node drains: in sync mode at most one batch can still be buffered
        assert controller.trainer.step_count <= held + 1
        drain.unlink()
        runner.join(timeout=120)
    finally:
        launcher.stop()
    assert "r" in result and result["r"].steps == 12
    assert len(trained) == len(set(trained)), trained
    assert controller.coord.queue.stats().num_expired_leases == 0  # returned, not expired
    assert time.monotonic() - t0 < 200


def test_rayjob_settings_on_one_machine(tmp_path: Path, moto: int) -> None:
    """The combination deploy/kuberay/rayjob.yaml uses, on this host: the job with Ray actors whose
    engine is an SGLang-API server (`slipstream serve` here, SGLang there) reached over HTTP,
    weights on S3 (moto) staged into a directory the server reads, a drain file configured."""
    from jobutil import start_server
    from s3util import make_bucket

    make_bucket(moto)
    save_random_init(tmp_path / "init", TINY)
    server, url = start_server(tmp_path, tmp_path / "init")
    creds = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
             "AWS_DEFAULT_REGION": "us-west-2"}  # fmt: skip
    try:
        job = start_job(tmp_path, "trainer.steps=4", "store.url=s3://bucket/rayjob",
                        f"store.endpoint_url=http://127.0.0.1:{moto}", "engine.type=http",
                        f"engine.url={url}", "engine.server_wait_s=60",
                        f"engine.weights_stage_dir={tmp_path / 'stage'}",
                        f"rollout.drain_file={tmp_path / 'drain'}", env=creds)  # fmt: skip
        out = finish(job, tmp_path, timeout_s=150)
        info = httpx.get(f"{url}/get_model_info", timeout=5).json()
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert sorted(out) == [1, 2, 3, 4]
    assert int(info["weight_version"]) >= 3  # sync mode: step 4 trained on version-3 samples
    staged = [p.name for p in (tmp_path / "stage" / "w0").iterdir()]
    assert staged == [f"v{int(info['weight_version']):08d}"], staged
    assert not (tmp_path / "run" / "store").exists()
    report = (tmp_path / "run" / "report.md").read_text()
    assert "**worker exit codes**: {0: 0}" in report, report
