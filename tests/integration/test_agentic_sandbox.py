"""Agentic episodes with real bwrap sandboxes: tool calls run in the episode's sandbox, whose
files persist across the episode's turns and never reach another episode (single use and
reuse); a sandbox killed mid-episode is an infrastructure failure that re-runs the episode (its
real reward is kept, never a 0 for the failure); a policy whose programs kill their sandbox
every time gets its task dropped and counted by the rollout worker and the coordinator, not
trained; after everything no sandbox, cgroup or journal entry is left.

The policy here is scripted (ScriptedEngine returns fixed token ids for each turn, with the
Engine protocol's futures), so that the tool calls are certain; the sandboxes, the environment,
the episode loop, the worker and the coordinator are the real ones.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from sandboxutil import needs_bwrap
from slipstream.config.rl import RolloutConfig
from slipstream.config.task import TaskConfig
from slipstream.engine.base import Completion, GenerateRequest
from slipstream.envs import EpisodeLimits, EpisodeRunner, make_env_factory, run_episodes
from slipstream.envs.python_tool import PythonToolEnv
from slipstream.envs.sandboxes import SandboxHost
from slipstream.rl.buffer import ExperienceBuffer
from slipstream.rl.coordinator import Coordinator
from slipstream.rl.queue import TaskQueue
from slipstream.rl.verifier import InProcessVerifier
from slipstream.rl.worker import RolloutWorker
from slipstream.sandbox import PoolOptions, SandboxTemplate
from slipstream.sandbox.cgroups import CgroupManager
from slipstream.sandbox.journal import Journal
from slipstream.tasks import Task, get_taskset

pytestmark = needs_bwrap
TEMPLATE = SandboxTemplate(backend="bwrap", memory_mib=256, workdir_mib=16)
TS = get_taskset(TaskConfig(name="tool_arithmetic", env="python_tool", ops=["*"]))
TOK = TS.tokenizer


def task(a: int, b: int) -> Task:
    return Task(f"t/{a}*{b}", f"{a}*{b}=", f"{a}*{b}=", {"a": a, "b": b, "op": "*",
                                                      "answer": a * b})  # fmt: skip


def turn(text: str, eos: bool = False) -> list[int]:
    return TOK.encode(text) + ([TOK.eos_id] if eos else [])


def host(tmp_path: Path, **opts: Any) -> SandboxHost:
    options = PoolOptions(**{"min_idle": 1, "max_idle": 2, "max_density": 4.0, **opts})
    return SandboxHost(TEMPLATE, options, state_dir=tmp_path / "state").start()


def assert_nothing_left(tmp_path: Path) -> None:
    assert Journal(tmp_path / "state").entries() == []
    mine = f"sb-{os.getpid()}-"
    assert [d for d in CgroupManager.detect("/sys/fs/cgroup").leftover_dirs() if mine in d] == []


def obs_text(result_ids: list[int]) -> str:
    return TOK.decode(result_ids)


@pytest.mark.parametrize("reuse", [False, True])
def test_files_persist_across_turns_and_never_leak_between_episodes(tmp_path: Path,
                                                                    reuse: bool) -> None:  # fmt: skip
    h = host(tmp_path, reuse=reuse, max_idle=1)
    limits = EpisodeLimits(max_observation_tokens=200)
    make = make_env_factory(TS, sandboxes=h, limits=limits)
    try:
        a = make()
        a.reset(task(6, 7))
        first_id = a._held.sandbox.sandbox_id  # type: ignore[attr-defined]
        r1 = a.step(turn("<py>open('notes.txt','w').write('secret-A');"
                         "open('/tmp/t','w').write('x');open('/dev/shm/s','w').write('y');"
                         "import subprocess;subprocess.Popen(['sleep','300'],start_new_session=True)"
                         ";print(6*7)</py>"), last=False)  # fmt: skip
        assert not r1.done and obs_text(r1.observation_ids) == "<out>42\n</out>"
        r2 = a.step(turn("<py>open('notes.txt').read()</py>"), last=False)  # a cell's value
        assert obs_text(r2.observation_ids) == "<out>'secret-A'\n</out>"  # state persists
        r3 = a.step(turn("42", eos=True), last=False)
        assert r3.done and r3.reward == 1.0 and a.usage.tool_calls == 2
        a.close()
        b = make()
        b.reset(task(2, 3))
        if reuse:  # the same sandbox, reset and scrubbed: the point of this case
            assert b._held.sandbox.sandbox_id == first_id  # type: ignore[attr-defined]
        r = b.step(turn("<py>import os,glob;print(os.listdir('.'),os.path.exists('/tmp/t'),"
                        "os.listdir('/dev/shm'),os.system('pgrep sleep >/dev/null'))</py>"),
                   last=False)  # fmt: skip
        # nothing of A: only B's own program file, no /tmp or /dev/shm file, no process of A's
        assert obs_text(r.observation_ids) == "<out>['cell0.py'] False [] 256\n</out>"
        b.close()
    finally:
        h.close()
    assert_nothing_left(tmp_path)


def test_teacher_observations_are_what_the_sandbox_prints(tmp_path: Path) -> None:
    ts = get_taskset(TaskConfig(name="tool_arithmetic", env="python_tool", ops=["*"],
                                min_digits=3, max_digits=4, demo_tool_use=1.0))  # fmt: skip
    h = host(tmp_path)
    make = make_env_factory(ts, sandboxes=h, limits=EpisodeLimits(max_observation_tokens=24))
    try:
        for i in range(6):
            t = ts.train(i)
            demo = make().demonstration(t)
            call_end = demo.loss_mask.index(0)
            obs_end = call_end + demo.loss_mask[call_end:].index(1)
            env = make()
            assert env.reset(t) == demo.prompt_ids
            r = env.step(demo.completion_ids[:call_end], last=False)
            env.close()
            assert (
                r.observation_ids == demo.completion_ids[call_end:obs_end]
            )  # SFT saw exactly this
    finally:
        h.close()
    assert_nothing_left(tmp_path)


def test_tool_output_is_capped_and_errors_are_observations(tmp_path: Path) -> None:
    h = host(tmp_path)
    limits = EpisodeLimits(max_observation_tokens=64, turn_timeout_s=2.0)
    env = PythonToolEnv(TS, sandboxes=h, limits=limits)
    try:
        env.reset(task(6, 7))
        big = env.step(turn("<py>print('a'*100000)</py>"), last=False)
        text = obs_text(big.observation_ids)
        assert len(big.observation_ids) <= 64 and text.startswith("<out>a") and "..." in text
        err = obs_text(env.step(turn("<py>1/0</py>"), last=False).observation_ids)
        assert "Error: division by zero" in err and err.endswith("[exit 1]\n</out>")
        slow = obs_text(env.step(turn("<py>while True: pass</py>"), last=False).observation_ids)
        assert slow == "<out>[timed out]\n</out>"
        last = env.step(turn("<py>print(42)</py>"), last=True)  # no turn may follow: scored
        assert last.done and last.reward == 0.0 and env.usage.tool_calls == 3
    finally:
        env.close()
        h.close()
    assert_nothing_left(tmp_path)


class ScriptedEngine:
    """The Engine protocol's submit/abort with a scripted policy: `script(prompt ids, sample
    index, turn)` -> the sampled ids; logprob -1 and version 0 per token."""

    def __init__(self, script: Callable[[list[int], int, int], list[int]]) -> None:
        self.script = script
        self.version = 0
        self.submitted: list[GenerateRequest] = []
        self.before_reply: Callable[[GenerateRequest], None] = lambda r: None

    def submit(self, request: GenerateRequest) -> Future:
        self.submitted.append(request)
        self.before_reply(request)
        fut: Future = Future()
        turn_no = TOK.decode(request.prompt_ids).count("<out>")
        comps = []
        for i in range(request.params.n):
            ids = self.script(request.prompt_ids, i, turn_no)
            comps.append(Completion(request.request_id, i, list(request.prompt_ids), ids,
                                    TOK.decode(ids), [-1.0] * len(ids), "stop",
                                    [0] * len(ids)))  # fmt: skip
        fut.set_result(comps)
        return fut

    def abort(self, request_id: str) -> None:
        pass

    def load_version(self, version: int, weights: Any) -> None:
        self.version = version


def tool_then_answer(prompt: list[int], i: int, turn_no: int) -> list[int]:
    expr = TOK.decode(prompt).split("=")[0]
    if turn_no == 0:
        return turn(f"<py>{expr}</py>")
    return turn(str(eval(expr)), eos=True)  # the test's own arithmetic  # noqa: S307


def test_sandbox_killed_mid_episode_reruns_the_episode(tmp_path: Path) -> None:
    h = host(tmp_path, max_idle=4)
    limits = EpisodeLimits(max_turns=4, max_observation_tokens=32)
    envs: list[PythonToolEnv] = []
    base = make_env_factory(TS, sandboxes=h, limits=limits)

    def make() -> PythonToolEnv:
        envs.append(base())  # type: ignore[arg-type]
        return envs[-1]

    engine = ScriptedEngine(tool_then_answer)
    killed: list[int] = []

    def kill_first_sandbox(req: GenerateRequest) -> None:
        # after episode 0's reset, before its first turn comes back: kill its sandbox from
        # outside (as an OOM killer or a dying host would)
        if not killed and envs and envs[0]._held is not None:
            pid = envs[0]._held.sandbox.record().pid
            assert pid
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    engine.before_reply = kill_first_sandbox
    with ThreadPoolExecutor(4) as pool:
        runner = EpisodeRunner(engine, make, TOK, limits, pool)  # type: ignore[arg-type]
        try:
            (out,) = run_episodes(runner, [task(123, 456)], n=3, timeout_s=120)
        finally:
            h.close()
    assert killed, "the test did not kill a sandbox"
    assert out.status == "done" and out.infra_failures == 1
    assert sorted(e.infra_retries for e in out.episodes) == [0, 0, 1]
    assert [e.reward for e in out.episodes] == [1.0, 1.0, 1.0]  # real rewards, no 0 for it
    for e in out.episodes:
        assert TOK.decode(e.completion_ids) == "<py>123*456</py><out>56088\n</out>56088"
        assert e.num_turns == 2 and e.usage.tool_calls == 1
    assert len(envs) == 4  # three episodes and one re-run
    assert_nothing_left(tmp_path)


def test_worker_drops_a_task_whose_sandbox_keeps_dying(tmp_path: Path) -> None:
    h = host(tmp_path, max_idle=4)

    def killer(prompt: list[int], i: int, turn_no: int) -> list[int]:
        # the first sample of a first turn (episode 0 of the group, and each of its re-runs):
        # a program that kills its sandbox's guest agent, every time
        if i == 0 and turn_no == 0:
            return turn("<py>import os,signal;os.kill(os.getppid(),signal.SIGKILL)</py>")
        return tool_then_answer(prompt, i, turn_no)

    cfg = RolloutConfig(group_size=2, tasks_per_lease=1, max_inflight_tasks=1, lease_ttl_s=60,
                        max_infra_retries=1, verify_threads=4, drain_timeout_s=5,
                        max_new_tokens=64)  # fmt: skip
    buffer = ExperienceBuffer(1, 4)
    coord = Coordinator(TaskQueue(TS.num_train, max_tasks=2), buffer)
    engine = ScriptedEngine(killer)
    worker = RolloutWorker(
        "w0",
        coord,
        engine,
        TS,
        InProcessVerifier(TS, h),
        cfg,  # type: ignore[arg-type]
        weights=None,
        max_new_tokens=64,
    )  # type: ignore[arg-type]
    t = threading.Thread(target=worker.run)
    t.start()
    try:
        deadline = time.monotonic() + 120
        while coord.queue.stats().num_done < 2:
            assert time.monotonic() < deadline and t.is_alive(), coord.status()
            time.sleep(0.05)
    finally:
        worker.request_stop()
        t.join(60)
        worker.verifier.close()
    status, m = coord.status(), buffer.metrics()
    assert status.dropped_tasks == 2 and status.queue_pending_tasks == 0  # not redelivered
    assert m["dropped_infra"] == 2 and m["infra_failures"] == 2 * (cfg.max_infra_retries + 1)
    assert len(buffer) == 0 and m["episodes"] == 0  # nothing of them reached the trainer
    assert worker.stats["tasks_dropped"] == 2 and worker.stats["groups_acked"] == 0
    assert_nothing_left(tmp_path)


def test_code_tests_env_revises_against_visible_tests(tmp_path: Path) -> None:
    code = get_taskset(TaskConfig(name="code", env="code_tests"))
    tok = code.tokenizer
    h = host(tmp_path)
    limits = EpisodeLimits(max_turns=3, max_observation_tokens=120)
    make = make_env_factory(code, sandboxes=h, limits=limits)
    add = Task("code/test/add", "", "add", {"problem": "add"})
    try:
        env = make()
        prompt = tok.decode(env.reset(add))
        assert "Visible tests:\n  add(1, 2) == 3\n  add(-5, 5) == 0\n" in prompt
        wrong = tok.encode("```python\ndef add(a, b):\n    return a - b\n```") + [tok.eos_id]
        r1 = env.step(wrong, last=False)
        obs = tok.decode(r1.observation_ids)
        assert not r1.done and obs.startswith("<out>visible tests: 0/2 passed")
        assert "add(1, 2): expected 3, got -1" in obs
        broken = tok.encode("```python\ndef add(a, b) return\n```") + [tok.eos_id]
        r2 = env.step(broken, last=False)
        assert "does not load: SyntaxError" in tok.decode(r2.observation_ids)
        right = tok.encode("```python\ndef add(a, b):\n    return a + b\n```") + [tok.eos_id]
        r3 = env.step(right, last=False)  # passes the visible tests: scored on all of them
        assert r3.done and r3.reward == 1.0 and "passed 4/4" in r3.reason
        assert env.usage.tool_calls == 3
        env.close()
        last = make()
        last.reset(add)
        r = last.step(wrong, last=True)  # no turn may follow: scored on the hidden tests
        assert r.done and r.reward == 0.25  # add(0, 0) == 0 passes with a - b
        last.close()
        demo = make().demonstration(add)
        assert demo.loss_mask == [1] * len(demo.completion_ids)
        assert tok.decode(demo.completion_ids).startswith("```python\ndef add")
    finally:
        h.close()
    assert_nothing_left(tmp_path)


def test_episodes_lease_sandboxes_from_the_node_host_agent(tmp_path: Path) -> None:
    """The same environment through a client of `slipstream sandbox serve` (SandboxHost's
    agent_url: rollout.sandbox_agent) instead of a private pool."""
    import socket
    import subprocess
    import sys

    from slipstream.config.sandbox import SandboxConfig

    sock, state = tmp_path / "agent.sock", tmp_path / "agent-state"
    agent = subprocess.Popen(
        [sys.executable, "-c", "import sys; from slipstream.cli import main; sys.exit(main())",
         "sandbox", "serve", "--socket", str(sock), f"--sandbox.state_dir={state}",
         "--sandbox.backend=bwrap", "--sandbox.memory_mib=128", "--sandbox.workdir_mib=16",
         "--sandbox.min_idle=1", "--sandbox.max_idle=2", "--sandbox.max_density=4.0"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            assert agent.poll() is None, agent.stderr.read()  # type: ignore[union-attr]
            probe = socket.socket(socket.AF_UNIX)
            try:
                probe.connect(str(sock))
                break
            except (FileNotFoundError, ConnectionRefusedError):
                assert time.monotonic() < deadline, "the host agent did not start serving"
                time.sleep(0.05)
            finally:
                probe.close()
        cfg = SandboxConfig(backend="bwrap", memory_mib=128, workdir_mib=16, min_idle=1,
                            max_idle=2, max_density=4.0, state_dir=str(tmp_path / "client"))  # fmt: skip
        h = SandboxHost.from_config(cfg, f"unix://{sock}").start()
        make = make_env_factory(TS, sandboxes=h, limits=EpisodeLimits(max_observation_tokens=64))
        try:
            a = make()
            a.reset(task(6, 7))
            a.step(turn("<py>open('f','w').write('kept')</py>"), last=False)
            r = a.step(turn("<py>open('f').read()</py>"), last=False)
            assert obs_text(r.observation_ids) == "<out>'kept'\n</out>"
            a.close()
            b = make()
            b.reset(task(6, 7))
            r = b.step(turn("<py>import os;os.listdir('.')</py>"), last=False)
            assert obs_text(r.observation_ids) == "<out>['cell0.py']\n</out>"
            assert b.step(turn("42", eos=True), last=False).reward == 1.0
            b.close()
        finally:
            h.close()
        _worker_leases_from_the_agent(tmp_path, f"unix://{sock}")
    finally:
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(60) == 0
        agent.stderr.close()  # type: ignore[union-attr]
    assert Journal(state).entries() == []


def _worker_leases_from_the_agent(tmp_path: Path, agent_url: str) -> None:
    """`slipstream run`'s worker assembly (launch/worker.py) with rollout.sandbox_agent: the
    worker's sandboxes are the agent's (its admission limit, max_density 4), not a private pool
    (this worker's [sandbox] says max_density 1), and the backend check defers to the agent."""
    from jobutil import publish_random_init
    from slipstream.config import load_config
    from slipstream.launch.worker import (
        WorkerSpec,
        build_worker,
        check_sandbox_backend,
        close_worker,
    )
    from slipstream.sandbox.agent_pool import AgentPool

    cfg = load_config(None, [
        f"run.output_dir={tmp_path}/run", "model.hidden_size=32", "model.num_hidden_layers=1",
        "model.num_attention_heads=2", "model.num_key_value_heads=1", "model.head_dim=8",
        "model.moe_intermediate_size=16", "model.num_experts=4", "run.num_threads=1",
        "model.max_position_embeddings=128", "task.name=tool_arithmetic", "task.env=python_tool",
        'task.ops=["*"]', "rollout.group_size=2", "rollout.max_inflight_tasks=2",
        "sandbox.backend=bwrap", "sandbox.memory_mib=128", "sandbox.workdir_mib=16",
        "sandbox.min_idle=1", "sandbox.max_idle=2", "sandbox.max_density=1.0",
        f"sandbox.state_dir={tmp_path}/worker-state", f"rollout.sandbox_agent={agent_url}",
    ])  # fmt: skip
    check_sandbox_backend(cfg)
    publish_random_init(cfg, tmp_path / "init")
    coord = Coordinator(TaskQueue(cfg.task.num_train), ExperienceBuffer(8, 4))
    worker = build_worker(WorkerSpec(("127.0.0.1", 0), b"\0", cfg.model_dump(mode="json")),
                          "w0.0", coord=coord)  # fmt: skip
    try:
        assert isinstance(worker.sandboxes._pool, AgentPool)
        capacity = worker.sandboxes.capacity()
        assert capacity is not None and capacity >= 4 * len(os.sched_getaffinity(0)) - 4
    finally:
        close_worker(worker)
    assert Journal(tmp_path / "worker-state").entries() == []
