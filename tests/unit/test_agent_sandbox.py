"""A sandboxed agent (`agent.sandbox = true`, envs/agent_launch.py `SandboxLauncher`): a real
agent process inside bwrap completes an episode through the in-sandbox forwarder and its
episode's Unix socket, token-exact; inside, it reaches no TCP port of the host (a listener the
test opens, the endpoint's own port), reads no host file outside its binds, and writes nowhere
but its work directory; a hang and a non-zero exit end the episode as without the sandbox. With `agent.sandbox_cgroup`
(where cgroups are writable: root) each run is in a cgroup of its own: an allocation past
`sandbox_memory_mib` is OOM-killed and the episode is an "oom" failure, a fork loop stops at
`sandbox_pids_max`, and no run's cgroup is left afterwards.
Where bwrap cannot create its namespaces, every test here is skipped with bwrap's reason."""

from __future__ import annotations

import os
import socket
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from agentutil import TOK, ScriptedEngine
from slipstream.config.agent import AgentConfig
from slipstream.envs import EpisodeLimits
from slipstream.envs.agent import AgentFailed, AgentRuntime
from slipstream.envs.agent_launch import SANDBOX_BASE_URL, SandboxLauncher
from slipstream.envs.agent_trajectory import segments
from slipstream.sandbox.cgroups import CgroupManager
from slipstream.tasks import Task


def _cgroups_writable() -> str | None:
    """None where this process can make cgroups (root), else why not."""
    try:
        CgroupManager.detect()
    except OSError as e:
        return str(e)
    return None


CGROUPS_UNAVAILABLE = _cgroups_writable()
needs_cgroups = pytest.mark.skipif(
    CGROUPS_UNAVAILABLE is not None, reason=f"cgroups not writable: {CGROUPS_UNAVAILABLE}"
)

TASK = Task("t/0", "12*34=", "12*34=", {"answer": 408})
REPLY = TOK.encode("408") + [TOK.eos_id]

# argv[1:]: what to try before the model call, as (kind, target) pairs; each outcome goes to
# result.json: "ok" or the exception's class name
AGENT = textwrap.dedent("""\
    import json, os, socket, subprocess, sys, urllib.request
    task = json.load(sys.stdin)
    out = {"base_url": os.environ["OPENAI_BASE_URL"], "home": os.environ["HOME"],
           "cwd": os.getcwd(), "tried": {}}
    args = sys.argv[1:]
    for kind, target in zip(args[::2], args[1::2]):
        try:
            if kind == "tcp":  # a port, or @FILE: the port written in FILE
                port = open(target[1:]).read() if target.startswith("@") else target
                socket.create_connection(("127.0.0.1", int(port)), timeout=5).close()
            elif kind == "read":
                open(target).read()
            elif kind == "write":
                open(target, "w").write("escaped")
            elif kind == "hang":
                subprocess.Popen(["sleep", target])  # a leftover child: it must die too
                subprocess.run(["sleep", target])
            elif kind == "exit":
                pass
            elif kind == "alloc":  # MiB, every page written
                out["allocated"] = len(b"x" * (int(target) << 20))
            elif kind == "fork":  # up to N children, alive at once, until a fork fails
                r, w = os.pipe()
                kids = []
                try:
                    for _ in range(int(target)):
                        pid = os.fork()
                        if pid == 0:
                            os.close(w)
                            os.read(r, 1)  # EOF once the parent closes its end
                            os._exit(0)
                        kids.append(pid)
                finally:
                    out["forked"] = len(kids)
                    os.close(w)
                    for pid in kids:
                        os.waitpid(pid, 0)  # zombies hold their pids
            out["tried"][kind + " " + target] = "ok"
        except Exception as e:
            out["tried"][kind + " " + target] = type(e).__name__
    def chat(messages):
        req = urllib.request.Request(
            os.environ["OPENAI_BASE_URL"] + "/chat/completions",
            data=json.dumps({"model": os.environ["OPENAI_MODEL"], "messages": messages}).encode(),
            headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                     "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.load(r)["choices"][0]["message"]
    msgs = [{"role": "user", "content": task["prompt"]}]
    msgs += [chat(msgs), {"role": "user", "content": "sure?"}]
    out["answer"] = chat(msgs)["content"]
    with open("result.json", "w") as f:
        json.dump(out, f)
    if "exit" in args:
        sys.exit(int(args[args.index("exit") + 1]))
""")


class _TaskSet:
    tokenizer = TOK


@pytest.fixture(scope="module")
def bwrap_works() -> None:
    """Skip (with bwrap's reason) where it cannot create a sandbox, e.g. without user
    namespaces; the runtime fails the same way at its start, naming agent.sandbox."""
    try:
        SandboxLauncher(AgentConfig(command="true", sandbox=True, sandbox_cgroup=False),
                        os.getcwd()).close()  # fmt: skip
    except ValueError as e:
        pytest.skip(str(e))


@pytest.fixture
def agent_dir(tmp_path: Path, bwrap_works: None) -> Path:
    d = tmp_path / "agent"
    d.mkdir()
    (d / "agent.py").write_text(AGENT)
    return d


def runtime(agent_dir: Path, *args: str, sandbox: bool = True, timeout_s: float = 30.0,
            **more: Any) -> AgentRuntime:  # fmt: skip
    """The test agent's runtime; sandboxed runs in cgroups where those are writable."""
    if sandbox:
        more = {"sandbox_cgroup": CGROUPS_UNAVAILABLE is None, **more}
    cfg = AgentConfig(command=" ".join(["{python}", str(agent_dir / "agent.py"), *args]),
                      sandbox=sandbox, sandbox_binds=[str(agent_dir)] if sandbox else [],
                      timeout_s=timeout_s, **more)  # fmt: skip
    return AgentRuntime(ScriptedEngine([REPLY]), _TaskSet(), cfg,  # type: ignore[arg-type]
                        EpisodeLimits(max_turns=4, max_turn_tokens=8),
                        scorer=lambda task, text: (float(text == "408"), "exact"))  # fmt: skip


def run_once(rt: AgentRuntime) -> tuple[Any, Any]:
    session = rt.endpoint.open(max_calls=4, max_sampled_tokens=64)
    return rt.run_agent(TASK, session, lambda: False), session


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    sock = socket.create_server(("127.0.0.1", 0))
    sock.setblocking(False)
    yield sock
    sock.close()


def test_a_sandboxed_agent_completes_a_token_exact_episode(agent_dir: Path) -> None:
    rt = runtime(agent_dir)
    try:
        run, session = run_once(rt)
        assert run.exit_code == 0, run.stderr
        out = run.output
        # inside: the forwarder's URL, the work directory at /sandbox
        assert out["base_url"] == SANDBOX_BASE_URL
        assert out["home"] == out["cwd"] == "/sandbox"
        assert out["answer"] == "408"
        assert [c.completion.token_ids for c in run.calls] == [REPLY, REPLY]
        (seg,) = segments([(c.prompt_ids, c.completion) for c in run.calls])
        assert seg.prompt_ids == TOK.chat_prompt([{"role": "user", "content": TASK.prompt}])
        sampled = [t for t, m in zip(seg.completion_ids, seg.loss_mask, strict=True) if m]
        assert sampled == REPLY + REPLY  # the engine's ids, as sampled
        (ep,) = rt.episodes(TASK, run, session)
        assert ep.completion_ids == seg.completion_ids and ep.reward == 1.0
        assert rt.stats.episodes == 1
    finally:
        rt.close()


def test_inside_no_host_port_no_host_file_no_write_outside_work(
    agent_dir: Path, tmp_path: Path, listener: socket.socket
) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("the reference answers")
    escape = tmp_path / "escaped.txt"
    in_bind = agent_dir / "written.txt"  # readable inside, never writable
    port = listener.getsockname()[1]
    endpoint_port = agent_dir / "endpoint_port"  # known once the endpoint runs
    rt = runtime(agent_dir, "tcp", str(port), "tcp", f"@{endpoint_port}", "read", str(secret),
                 "write", str(escape), "write", str(in_bind), "write", "result-probe.json")  # fmt: skip
    try:
        rt.endpoint.start()
        endpoint_port.write_text(str(rt.endpoint.port))
        run, _ = run_once(rt)
    finally:
        rt.close()
    assert run.exit_code == 0, run.stderr
    tried = run.output["tried"]
    assert tried[f"tcp {port}"] == "ConnectionRefusedError"  # its loopback is not the host's
    # nor the worker's endpoint port: other episodes are reachable only through their sockets
    assert tried[f"tcp @{endpoint_port}"] == "ConnectionRefusedError"
    assert tried[f"read {secret}"] == "FileNotFoundError"
    # the path exists inside only on its private /tmp (where the bind's parents were made)
    assert tried[f"write {escape}"] == "ok" and not escape.exists()
    assert tried[f"write {in_bind}"] == "OSError" and not in_bind.exists()  # read-only bind
    assert tried["write result-probe.json"] == "ok"  # its work directory is writable
    with pytest.raises(BlockingIOError):
        listener.accept()  # nothing came through
    assert len(run.calls) == 2  # and its own episode's endpoint still answered


def test_a_hang_is_killed_sandbox_and_all(agent_dir: Path) -> None:
    marker = "4242.5"  # sleep's argument: finds the agent's processes in the host's /proc
    rt = runtime(agent_dir, "hang", marker, timeout_s=3.0)
    try:
        run, session = run_once(rt)
        assert run.timed_out and run.exit_code is None
        with pytest.raises(AgentFailed, match="agent.timeout_s"):
            rt.episodes(TASK, run, session)
    finally:
        rt.close()
    deadline = time.monotonic() + 15.0  # the pid namespace ends with bwrap: wait for it
    while (left := _processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"agent processes left: {left}"
    assert not _run_cgroups()


def _run_cgroups() -> list[str]:
    """This worker's agent run cgroups that exist now (none where cgroups are not writable)."""
    if CGROUPS_UNAVAILABLE is not None:
        return []
    mine = f"agent-{os.getpid()}-"
    return [
        d for d in CgroupManager.detect().leftover_dirs() if os.path.basename(d).startswith(mine)
    ]


@needs_cgroups
def test_past_its_memory_limit_the_agent_is_oom_killed_a_counted_failure(agent_dir: Path) -> None:
    # 1 GiB written in a 128 MiB cgroup (its address-space ulimit, agent.memory_mib, is 2 GiB):
    # without the cgroup the allocation succeeds and the episode completes
    rt = runtime(agent_dir, "alloc", "1024", sandbox_memory_mib=128)
    try:
        run, session = run_once(rt)
        assert run.exit_code == 128 + 9 and not run.calls, run.stderr  # SIGKILLed, before a call
        assert run.confinement.oom_kills >= 1 and run.output is None
        with pytest.raises(AgentFailed, match=r"OOM-killed at agent.sandbox_memory_mib = 128") as e:
            rt.episodes(TASK, run, session)
        assert e.value.kind == "oom" and rt.stats.oom == 1 and rt.stats.episodes == 0
    finally:
        rt.close()
    assert not _run_cgroups()  # killed and removed with the run


@needs_cgroups
def test_a_fork_loop_stops_at_its_pids_limit(agent_dir: Path) -> None:
    # up to 200 children at once; the cgroup's 32 pids (bwrap, its init, the forwarder and its
    # thread, sh and the agent included) stop it well before, and the episode goes on
    rt = runtime(agent_dir, "fork", "200", sandbox_pids_max=32)
    try:
        run, session = run_once(rt)
        assert run.exit_code == 0, run.stderr
        assert (
            0 < run.output["forked"] < 32 and run.output["tried"]["fork 200"] == "BlockingIOError"
        )  # EAGAIN
        assert run.confinement.pids_max_hits >= 1
        (ep,) = rt.episodes(TASK, run, session)
        assert ep.reward == 1.0 and rt.stats.pids_limited == 1
    finally:
        rt.close()
    assert not _run_cgroups()


def test_cgroups_not_writable_is_one_line_naming_the_key(
    agent_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from slipstream.envs import agent_launch

    monkeypatch.setattr(agent_launch, "CGROUP_ROOT", str(tmp_path / "no-cgroups"))
    with pytest.raises(ValueError) as e:
        SandboxLauncher(AgentConfig(command="true", sandbox=True), os.getcwd())
    msg = str(e.value)
    assert msg.startswith("agent.sandbox_cgroup = true needs writable cgroups (no cgroup v2")
    assert "set agent.sandbox_cgroup = false" in msg and "\n" not in msg
    SandboxLauncher(AgentConfig(command="true", sandbox=True, sandbox_cgroup=False),
                    os.getcwd()).close()  # the documented opt-out  # fmt: skip


def test_a_nonzero_exit_fails_the_episode(agent_dir: Path) -> None:
    rt = runtime(agent_dir, "exit", "3")
    try:
        run, session = run_once(rt)
        assert run.exit_code == 3 and len(run.calls) == 2
        with pytest.raises(AgentFailed, match="status 3") as e:
            rt.episodes(TASK, run, session)
        assert e.value.kind == "exit" and rt.stats.exit_nonzero == 1
    finally:
        rt.close()


def test_config_errors_name_their_key(agent_dir: Path, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    with pytest.raises(
        ValidationError, match="agent.sandbox = true does not work with agent.preload"
    ):
        AgentConfig(command="{python} x.py", sandbox=True, preload=["json"])
    with pytest.raises(ValidationError, match="agent.sandbox_binds is set but agent.sandbox"):
        AgentConfig(command="true", sandbox_binds=["/x"])
    outside = AgentConfig(command=f"{{python}} {agent_dir / 'agent.py'}", sandbox=True)
    with pytest.raises(ValueError, match=r"^agent.sandbox_binds: the agent's script .*agent.py"):
        SandboxLauncher(outside, os.getcwd())
    # a bwrap that cannot create namespaces: one line naming agent.sandbox, with its reason
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "bwrap").write_text("#!/bin/sh\necho 'bwrap: No permissions to create new "
                                "namespace' >&2\nexit 1\n")  # fmt: skip
    (fake / "bwrap").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    with pytest.raises(ValueError) as e:
        SandboxLauncher(AgentConfig(command="true", sandbox=True), os.getcwd())
    assert str(e.value) == ("agent.sandbox = true: bwrap cannot start a sandbox here (exit 1: "
                            "bwrap: No permissions to create new namespace)")  # fmt: skip


def _processes_with(arg: str) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if arg.encode() in f.read().split(b"\0"):
                    out.append(int(pid))
        except (OSError, ValueError):
            pass
    return out


def test_the_episode_socket_serves_its_episode_alone(agent_dir: Path) -> None:
    """Through the Unix socket every path is under the episode's prefix: another episode's
    path does not exist there, and the episode's own key is still required."""
    import http.client

    rt = runtime(agent_dir)
    try:
        mine = rt.endpoint.open(max_calls=4, max_sampled_tokens=64)
        other = rt.endpoint.open(max_calls=4, max_sampled_tokens=64)
        path = str(agent_dir.parent / "ep.sock")
        mine.serve_unix(path)

        def get(url: str, key: str) -> int:
            conn = http.client.HTTPConnection("localhost", timeout=10)
            conn.sock = socket.socket(socket.AF_UNIX)
            conn.sock.connect(path)
            conn.request("GET", url, headers={"Authorization": f"Bearer {key}"})
            status = conn.getresponse().status
            conn.close()
            return status

        assert get("/v1/models", mine.api_key) == 200
        assert get("/v1/models", other.api_key) == 401
        assert get(f"/s/{other.id}/v1/models", other.api_key) == 404
        mine.close()
        deadline = time.monotonic() + 10.0  # the server stops at its next tick
        while time.monotonic() < deadline:
            try:
                get("/v1/models", mine.api_key)
            except OSError:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the episode's socket still answers after the episode ended")
        other.close()
    finally:
        rt.close()
