"""RL verification through the sandbox pool: SandboxVerifier with real bwrap sandboxes scores the
code task's references 1.0 and wrong or hostile candidates < 1 from several threads at once (an
infrastructure failure raises InfraError, never a reward) and leaves no sandbox, cgroup, journal
entry or process after close(); one rollout worker built by the local launcher on the `code` task
verifies through its pool and stops it on exit."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from jobutil import publish_random_init
from sandboxutil import needs_bwrap
from slipstream.config import load_config
from slipstream.config.task import TaskConfig
from slipstream.envs import InfraError
from slipstream.launch.worker import WorkerSpec, build_worker, close_worker
from slipstream.rl.buffer import ExperienceBuffer
from slipstream.rl.coordinator import Coordinator
from slipstream.rl.queue import TaskQueue
from slipstream.rl.verifier import (
    InProcessVerifier,
    LatencyInjector,
    SandboxVerifier,
    make_verifier,
    wants_sandbox,
)
from slipstream.sandbox import PoolOptions, SandboxTemplate
from slipstream.sandbox.cgroups import CgroupManager
from slipstream.sandbox.journal import Journal, process_alive
from slipstream.tasks import Task, get_taskset
from slipstream.tasks.code import BY_NAME

pytestmark = needs_bwrap

TEMPLATE = SandboxTemplate(backend="bwrap", memory_mib=256, workdir_mib=32)


def code_task(ts, problem: str) -> Task:
    return Task(f"code/test/{problem}", BY_NAME[problem].prompt, problem, {"problem": problem})


def fenced(src: str) -> str:
    return f"Here it is:\n```python\n{src}\n```\n"


def children_of(pid: int) -> list[str]:
    """Live (non-zombie) child processes of pid, as 'pid comm'."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        comm_end = stat.rindex(")")
        state, ppid = stat[comm_end + 2 :].split()[:2]
        if int(ppid) == pid and state != "Z":
            out.append(f"{d.name} {stat[stat.index('(') + 1 : comm_end]}")
    return out


def test_sandbox_verifier_concurrent_hostile_and_clean_stop(tmp_path: Path) -> None:
    ts = get_taskset(TaskConfig(name="code", tokenizer="char"))
    assert wants_sandbox("auto", ts) and not wants_sandbox("never", ts)
    assert not wants_sandbox("auto", get_taskset(TaskConfig(name="arithmetic")))
    with pytest.raises(ValueError, match="no sandboxed verifier"):
        wants_sandbox("always", get_taskset(TaskConfig(name="countdown")))

    # children that other tests left running (e.g. multiprocessing's resource tracker) are not ours
    before = set(children_of(os.getpid()))
    marker = tmp_path / "pwned"
    refs = ["add", "is_even", "binary_string"]
    cases: list[tuple[str, Task, str, bool]] = [  # label, task, completion, should score 1.0
        *[(f"reference {p}", code_task(ts, p), fenced(BY_NAME[p].reference), True) for p in refs],
        ("off by one", code_task(ts, "add"), fenced("def add(a, b):\n    return a + b + 1"), False),
        ("infinite loop", code_task(ts, "add"), fenced("def add(a, b):\n    while True: pass"), False),
        ("os.system", code_task(ts, "add"),
         fenced(f"import os\nos.system('touch {marker}; kill -9 -1')\ndef add(a, b):\n    return 0"),
         False),
        ("syntax error", code_task(ts, "add"), fenced("def add(a, b)\n    return a+b"), False),
        ("kills the agent", code_task(ts, "add"),
         fenced("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)"), False),
        ("no code", code_task(ts, "add"), "I don't know \x00\udcff", False),
    ]  # fmt: skip
    opts = PoolOptions(min_idle=2, max_idle=2, max_density=2.0, create_concurrency=2)
    verifier = SandboxVerifier(ts, TEMPLATE, opts, state_dir=tmp_path / "state").start()
    try:
        with ThreadPoolExecutor(4) as ex:  # like the worker's verify thread pool
            results = list(ex.map(lambda c: verifier.verify(c[1], c[2]), cases))
        summary = verifier.summary()
    finally:
        verifier.close()
    for (label, _, _, good), (reward, reason) in zip(cases, results, strict=True):
        assert isinstance(reason, str) and reason
        if good:
            assert reward == 1.0, (label, reason)
        else:
            assert 0.0 <= reward < 1.0, (label, reason)
    by_label = {c[0]: r for c, r in zip(cases, results, strict=True)}
    assert "timed out" in by_label["infinite loop"][1]
    assert "does not load" in by_label["syntax error"][1]
    assert "sandbox failure" in by_label["kills the agent"][1]
    assert not marker.exists(), "a candidate wrote to the host's filesystem"
    assert summary["infra_failures"] == 0 and summary["verified"] == len(cases)
    assert summary["acquires"] == len(cases)  # one sandbox per verification (single use)

    # after close: nothing left, and verify raises InfraError
    st = verifier.stats()
    assert st is not None and st.live == 0 and st.in_use == 0 and st.destroyed == st.created
    assert Journal(tmp_path / "state").entries() == []
    mine = f"sb-{os.getpid()}-"
    cgroups = CgroupManager.detect("/sys/fs/cgroup")
    assert [d for d in cgroups.leftover_dirs() if mine in d] == []
    new_children = set(children_of(os.getpid())) - before
    assert [c for c in new_children if "bwrap" in c or "python" in c] == []
    assert not any(t.name == "sandbox-host" for t in threading.enumerate())
    # an infrastructure failure is not a reward: verify raises InfraError (counted), no 0.0
    with pytest.raises(InfraError, match="not running"):
        verifier.verify(cases[0][1], cases[0][2])
    assert verifier.summary()["infra_failures"] == 1


def test_make_verifier_selects_by_config_and_task(tmp_path: Path) -> None:
    cfg = load_config(None, ["task.name=arithmetic"])
    v = make_verifier(cfg.sandbox, get_taskset(cfg.task))
    assert isinstance(v, InProcessVerifier)
    cfg = load_config(None, ["task.name=code", "sandbox.verify_in_sandbox=never"])
    assert isinstance(make_verifier(cfg.sandbox, get_taskset(cfg.task)), InProcessVerifier)


TINY = [
    "model.hidden_size=32", "model.num_hidden_layers=1", "model.num_attention_heads=2",
    "model.num_key_value_heads=1", "model.head_dim=8", "model.intermediate_size=32",
    "model.moe_intermediate_size=16", "model.num_experts=4", "model.max_position_embeddings=320",
    "engine.max_seq_len=320", "engine.max_new_tokens=8", "eval.num_prompts=4", "run.num_threads=1",
    "task.name=code", "task.num_heldout=4",
]  # fmt: skip


def test_rollout_worker_on_code_task_verifies_in_sandbox_pool(tmp_path: Path) -> None:
    state = tmp_path / "sandbox-state"
    cfg = load_config(None, [
        f"run.output_dir={tmp_path}/run", *TINY, "rollout.group_size=2",
        "rollout.tasks_per_lease=2", "rollout.max_inflight_tasks=2", "rollout.lease_ttl_s=60",
        "rollout.verify_threads=2", "rollout.drain_timeout_s=5", "rollout.verify_latency=lognormal",
        "rollout.verify_latency_p50_s=0.01", "sandbox.memory_mib=256", "sandbox.workdir_mib=32",
        "sandbox.min_idle=1", "sandbox.max_idle=2", "sandbox.max_density=2.0",
        f"sandbox.state_dir={state}",
    ])  # fmt: skip
    publish_random_init(cfg, tmp_path / "init")
    coord = Coordinator(TaskQueue(cfg.task.num_train), ExperienceBuffer(8, 4))
    spec = WorkerSpec(("127.0.0.1", 0), b"\0", cfg.model_dump(mode="json"))  # coord is given
    worker = build_worker(spec, "w0.0", coord=coord)
    assert isinstance(worker.verifier, LatencyInjector)  # wraps the sandbox verifier
    verifier = worker.verifier.inner
    assert isinstance(verifier, SandboxVerifier)
    runner = threading.Thread(target=worker.run, name="worker")
    try:
        runner.start()
        deadline = time.monotonic() + 60
        while coord.queue.stats().num_done < 2:
            assert runner.is_alive() and time.monotonic() < deadline, "worker produced nothing"
            time.sleep(0.05)
        report = worker.report()  # what /metrics exports per worker
        assert report["weight_version"] == 0.0 and report["sandbox_pool_vcpu_capacity"] > 0
        assert report["sandbox_pool_acquires"] >= 1 and report["samples"] >= 2
        worker.request_stop()  # what the worker process's SIGTERM handler does
        runner.join(timeout=30)
        assert not runner.is_alive()
        summary = verifier.summary()
    finally:
        worker.request_stop()
        runner.join(timeout=30)
        close_worker(worker)
    done = coord.queue.stats().num_done
    assert summary["acquires"] >= done * cfg.rollout.group_size >= 4
    assert summary["verified"] == summary["acquires"] and summary["infra_failures"] == 0
    groups = coord.snapshot()["buffer"]["groups"]
    assert len(groups) == done and all(len(g["samples"]) == 2 for g in groups)
    assert Journal(state).entries() == []
    assert verifier.stats().live == 0  # type: ignore[union-attr]
    mine = f"sb-{os.getpid()}-"
    assert [d for d in CgroupManager.detect("/sys/fs/cgroup").leftover_dirs() if mine in d] == []


def test_worker_process_sigterm_stops_its_pool(tmp_path: Path) -> None:
    from slipstream.launch.local import LocalLauncher

    state = tmp_path / "sandbox-state"
    cfg = load_config(None, [
        f"run.output_dir={tmp_path}/run", *TINY, "rollout.num_workers=1", "rollout.group_size=2",
        "rollout.tasks_per_lease=2", "rollout.max_inflight_tasks=2", "rollout.lease_ttl_s=120",
        "rollout.drain_timeout_s=2", "trainer.groups_per_step=8", "buffer.max_staleness=4",
        "sandbox.memory_mib=256", "sandbox.workdir_mib=32", "sandbox.min_idle=1",
        "sandbox.max_idle=1", "sandbox.max_density=2.0", f"sandbox.state_dir={state}",
    ])  # fmt: skip
    publish_random_init(cfg, tmp_path / "init")
    coord = Coordinator(TaskQueue(cfg.task.num_train), ExperienceBuffer(8, 4))
    launcher = LocalLauncher(cfg, coord, restart=False)
    launcher.start()
    try:
        deadline = time.monotonic() + 90
        live: list[dict] = []  # the worker's running sandboxes (warm or in use), from its journal
        while coord.queue.stats().num_done < 2 or not live:
            assert launcher.procs[0].poll() is None, "worker exited early (see its log)"
            assert time.monotonic() < deadline, "worker produced nothing"
            time.sleep(0.05)
            live = [e for e in Journal(state).entries() if e.get("pid")]
        proc = launcher.procs[0]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        launcher.stop()
    assert Journal(state).entries() == []
    cgroups = CgroupManager.detect("/sys/fs/cgroup")
    assert [d for d in cgroups.leftover_dirs() if f"sb-{proc.pid}-" in d] == []
    assert [e["sandbox_id"] for e in live if process_alive(e["pid"], e["pid_start_ticks"])] == []
    assert coord.queue.stats().num_leased == 0


@pytest.mark.parametrize(("task", "fits"), [
    (["task.name=code"], True),  # one sandbox per verification, borrowed and queued
    (["task.name=tool_arithmetic", "task.env=python_tool", "task.ops=[\"*\"]",
      "model.max_position_embeddings=320"], False),  # every episode holds one from reset
])  # fmt: skip
def test_sandbox_capacity_check_applies_to_episodes_that_hold_one(
    tmp_path: Path, task: list[str], fits: bool
) -> None:
    """A pool smaller than max_inflight_tasks x group_size is refused only for environments
    whose episodes hold a sandbox for their whole length (`bench pipeline --task code --sandbox
    bwrap` crash-looped its workers on this check)."""
    inflight = 2 * len(os.sched_getaffinity(0))  # need 4 x cores > 1 x cores of capacity
    cfg = load_config(None, [
        f"run.output_dir={tmp_path}/run", *TINY, *task, "rollout.group_size=2",
        f"rollout.max_inflight_tasks={inflight}", "sandbox.memory_mib=256",
        "sandbox.workdir_mib=32", "sandbox.min_idle=0", "sandbox.max_idle=1",
        "sandbox.max_density=1.0", f"sandbox.state_dir={tmp_path}/state",
    ])  # fmt: skip
    publish_random_init(cfg, tmp_path / "init")
    coord = Coordinator(TaskQueue(cfg.task.num_train), ExperienceBuffer(8, 4))
    spec = WorkerSpec(("127.0.0.1", 0), b"\0", cfg.model_dump(mode="json"))
    if fits:
        worker = build_worker(spec, "w0.0", coord=coord)
        try:
            capacity = worker.sandboxes.capacity()
            assert capacity is not None and capacity < inflight * 2
        finally:
            close_worker(worker)
    else:
        with pytest.raises(ValueError, match="max_inflight_tasks x rollout.group_size"):
            build_worker(spec, "w0.0", coord=coord)
    assert Journal(tmp_path / "state").entries() == []
