"""`agent.preload`: agent runs forked from a warm template (envs/agent_launch.py) against the
fresh `/bin/sh -c` start. Small Python agents written by each test run through
`AgentRuntime.run_agent` (the one code path around the process: files, bound, kill) with the
scripted engine's endpoint; the template preloads `colorsys`, a module a fresh interpreter does
not import, so an agent can tell which way it was started."""

from __future__ import annotations

import json
import logging
import os
import signal
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from agentutil import TOK, ScriptedEngine
from slipstream.config.agent import AgentConfig, python_command
from slipstream.envs import EpisodeLimits
from slipstream.envs.agent import AgentRun, AgentRuntime
from slipstream.envs.agent_launch import TEMPLATE_LOST, ForkLauncher
from slipstream.tasks import Task

TASK = Task("t/0", "12*34=", "12*34=", {"answer": 408})

# prints what it saw as JSON (stdout), a line on stderr, writes result.json; exits with
# argv[1] (an int), or raises when argv[1] is "raise"
PROBE = """\
import json, os, sys
task = json.load(sys.stdin)
seen = {"argv": sys.argv, "cwd": os.getcwd(), "env": dict(os.environ), "task": task,
        "path0": sys.path[0], "preloaded": "colorsys" in sys.modules, "name": __name__}
print(json.dumps(seen))
print("to stderr", file=sys.stderr)
with open("result.json", "w") as f:
    json.dump({"tool_calls": 2}, f)
if sys.argv[1] == "raise":
    raise ValueError("boom")
sys.exit(int(sys.argv[1]))
"""


class _TaskSet:
    """What AgentRuntime reads of a task set: its tokenizer (the runs here sample nothing)."""

    tokenizer = TOK


def runtime(command: str, **agent: Any) -> AgentRuntime:
    cfg = AgentConfig(command=command, **agent)
    return AgentRuntime(ScriptedEngine([TOK.encode("1")]), _TaskSet(), cfg,  # type: ignore[arg-type]
                        EpisodeLimits(max_turns=2, max_turn_tokens=4),
                        scorer=lambda task, text: (0.0, ""))  # fmt: skip


def run(rt: AgentRuntime, stopped: Any = lambda: False) -> tuple[AgentRun, Any]:
    session = rt.endpoint.open(max_calls=2, max_sampled_tokens=8)
    return rt.run_agent(TASK, session, stopped), session


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    path = tmp_path / "probe.py"
    path.write_text(PROBE)
    return path


def _gone(pid: int) -> bool:
    """The process no longer runs (absent, or a zombie nobody reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
    except (FileNotFoundError, IndexError):
        return True


def _wait_for(cond: Any, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_forked_agent_sees_exactly_its_episode(probe: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("SLIPSTREAM_LEAK_CHECK", "worker")  # in the worker's env, not the agent's
    # a preloaded module that sets a variable at import (some libraries do): the template's
    # environment has it, the agent's must not
    (probe.parent / "leaky.py").write_text("import os\nos.environ['FROM_TEMPLATE'] = '1'\n")
    rt = runtime(f"{{python}} {probe} 3 'two words'", preload=["colorsys", "leaky"],
                 env={"PYTHONPATH": str(probe.parent)})  # fmt: skip
    try:
        out, session = run(rt)
    finally:
        rt.close()
    seen = json.loads(out.stdout)
    assert seen["preloaded"] and seen["name"] == "__main__"  # forked from the template
    assert out.exit_code == 3 and not out.timed_out
    assert seen["argv"] == [str(probe), "3", "two words"]
    work = seen["cwd"]
    assert Path(work).name == "work" and Path(work).parent.name.startswith("slipstream-agent-")
    assert seen["env"] == rt.environment(session, work)  # nothing of the template or the worker
    assert seen["path0"] == str(probe.parent)
    assert seen["task"] == TASK.to_dict()
    assert out.stderr == "to stderr\n" and out.output == {"tool_calls": 2}


@pytest.mark.parametrize("how", ["exit", "raise", "module"])
def test_forked_and_popen_runs_leave_the_same(probe: Path, how: str) -> None:
    command = f"{{python}} {probe} 5" if how == "exit" else f"{{python}} {probe} raise"
    env = {}
    if how == "module":  # `{python} -m probe 5`, found on PYTHONPATH
        command, env = "{python} -m probe 5", {"PYTHONPATH": str(probe.parent)}
    runs = []
    for preload in ([], ["colorsys"]):
        rt = runtime(command, preload=preload, env=env)
        try:
            out, _ = run(rt)
        finally:
            rt.close()
        seen = json.loads(out.stdout)
        seen["env"].pop("PWD", None)  # /bin/sh exports PWD; a forked run has no shell
        if how == "module":  # `python -m`: sys.path[0] is the (per-run) work directory
            seen["path0"] = seen["path0"] == seen["cwd"]
        for k in ("cwd", "env", "preloaded"):  # the work dir and the session differ per run
            seen[k] = None if k != "env" else sorted(seen[k])
        runs.append((out.exit_code, seen, out.stderr, out.output))
    popen, forked = runs
    assert forked == popen
    assert popen[0] == {"exit": 5, "module": 5, "raise": 1}[how]
    if how == "raise":
        assert popen[2].startswith("to stderr\nTraceback") and popen[2].endswith("boom\n")
    if how == "module":
        assert popen[1]["argv"][0] == str(probe)  # as `python -m`: the module's file


def test_a_timeout_kills_the_forked_agents_whole_group(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    agent = tmp_path / "agent.py"
    agent.write_text(
        textwrap.dedent(f"""\
        import os, subprocess, time
        child = subprocess.Popen(["sleep", "60"])
        with open({str(pids)!r} + ".tmp", "w") as f:
            f.write(f"{{os.getpid()}} {{child.pid}}")
        os.rename({str(pids)!r} + ".tmp", {str(pids)!r})
        time.sleep(60)
    """)
    )
    rt = runtime(f"{{python}} {agent}", preload=["colorsys"], timeout_s=1.0)

    def started() -> bool:  # hold the run loop until the agent and its child run
        _wait_for(pids.exists, "the agent's pid file")
        return False

    try:
        t0 = time.monotonic()
        out, _ = run(rt, started)
    finally:
        rt.close()
    assert out.timed_out and out.exit_code is None
    assert time.monotonic() - t0 < 30
    agent_pid, child_pid = map(int, pids.read_text().split())
    assert _gone(agent_pid) and _gone(child_pid)  # the group was SIGKILLed, the child too


def test_a_dead_template_is_restarted_and_its_runs_end(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    # the agent's first run writes its pid to `marker` and exits 0 once its parent (the
    # template) is gone; later runs exit 0 at once
    marker = tmp_path / "started"
    agent = tmp_path / "agent.py"
    agent.write_text(
        textwrap.dedent(f"""\
        import os, sys, time
        if os.path.exists({str(marker)!r}):
            sys.exit(0)
        template = os.getppid()
        with open({str(marker)!r} + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename({str(marker)!r} + ".tmp", {str(marker)!r})
        while os.getppid() == template:
            time.sleep(0.01)
    """)
    )
    rt = runtime(f"{{python}} {agent}", preload=["colorsys"])
    launcher = rt.launcher
    assert isinstance(launcher, ForkLauncher)
    try:
        # a template killed while a run is in flight: the run goes on to its end, which is a
        # failure (its exit code is lost), and its group is killed as ever
        first = launcher.template_pid

        def kill_template() -> bool:
            if marker.exists() and not _gone(first):
                os.kill(first, signal.SIGKILL)
            return False

        with caplog.at_level(logging.WARNING, logger="slipstream.envs.agent_launch"):
            out, _ = run(rt, kill_template)
            assert out.exit_code == TEMPLATE_LOST and not out.timed_out
            assert _gone(int(marker.read_text())) and _gone(first)
            # the next run starts a new template (logged once) and runs
            out, _ = run(rt)
        assert out.exit_code == 0
        assert launcher.template_pid != first
        assert [r.getMessage() for r in caplog.records if "starting a new" in r.getMessage()] == [
            f"agent template process {first} died (exit -9); starting a new one"
        ]
    finally:
        rt.close()
    assert _gone(launcher.template_pid)  # close() ended it


def test_preload_errors_name_the_key_or_the_module(probe: Path) -> None:
    with pytest.raises(ValueError, match="no_such_module_xyz.*ModuleNotFoundError"):
        runtime(f"{{python}} {probe} 0", preload=["colorsys", "no_such_module_xyz"])
    for bad in ["sh run.sh", "{python} -u agent.py", "{python} agent.py | tee log",
                "{python} agent.py $HOME", "cd /tmp && {python} agent.py", "{python}",
                "{python} -m", "{python} agent.py > out", "A=1 {python} agent.py"]:  # fmt: skip
        with pytest.raises(ValidationError, match="agent.preload needs agent.command"):
            AgentConfig(command=bad, preload=["openai"])
        AgentConfig(command=bad)  # without preload any shell command goes
    with pytest.raises(ValidationError, match="agent.preload: 'not a module'"):
        AgentConfig(command="{python} a.py", preload=["not a module"])
    assert python_command("{python} {cwd}/a.py x 'y z'").args == ("x", "y z")
    assert python_command("{python} -m pkg.agent --n 3").module == "pkg.agent"
