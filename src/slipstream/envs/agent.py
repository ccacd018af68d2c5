"""`agent`: the user's agent program as the environment. Each episode runs `agent.command` once,
as a local process group, with the task on stdin and its own OpenAI-compatible endpoint in
`OPENAI_BASE_URL` / `OPENAI_API_KEY` / `OPENAI_MODEL` (envs/agent_endpoint.py); the episode's
samples are the calls the engine answered, merged into token-exact sequences
(envs/agent_trajectory.py), rewarded once per episode. docs/agents.md is the guide.

    runtime = AgentRuntime(engine, taskset, agent_cfg, limits, scorer=verifier.verify, ...)
    make_env = runtime.factory()          # the EpisodeRunner's factory; runtime.close() at the end

The process:
- `/bin/sh -c` with the command (`{python}` = this interpreter), in a fresh work directory
  (HOME too), stdin = the task as JSON (`Task.to_dict()`: task_id, prompt, key, meta: the
  task's columns, the reference answer included), an environment of PATH, LANG, HOME, the
  three OPENAI_* variables and `agent.env`; nothing else of the worker's environment.
- Its own session (`setsid`): the whole process group is SIGKILLed when the agent exits (its
  leftover children), at `agent.timeout_s`, or when the group is aborted.
- `ulimit`: address space `agent.memory_mib`, file size and kept output `agent.max_output_bytes`,
  no core files.
- With `agent.preload` (a `{python} SCRIPT` / `{python} -m MODULE` command), the same process
  (own session, the same environment, cwd, files and limits) is forked from a warm template
  that imported those modules once, instead of a fresh interpreter (envs/agent_launch.py). Only
  that start differs; everything here around it (bound, kill, output) is one code path.

How an episode ends:
- exit 0 with at least one sampled token: reward = the task's verifier on the last assistant
  message (the last call's completion text). Its output (`agent.result_file` in the work dir,
  else stdout when it parses as JSON) is kept as `agent_output` for reward functions; an integer
  `tool_calls` in it is the episode's tool-call count in the run's metrics.
- a failure: a non-zero exit (unless `agent.failed_exit_is_failure = false`), the wall-clock
  bound, no call sampled anything: `AgentFailed` (an InfraError), so the episode loop re-runs
  the episode and after `rollout.max_infra_retries` drops the task, counted; none of its tokens
  are trained on and no reward is made up. Refused calls (over `max_calls` or the token budget,
  malformed requests) are answered 4xx and counted; what the agent does then is its business.

The reward is the worker's Verifier on the last assistant message (the `[[reward.functions]]`
RewardSet: per-sample functions here, group functions over the group's episodes in the episode
loop, every sample of an episode getting its episode's; without functions, the task's
verifier). Per-sample functions also get the keyword arguments `messages` (the final
conversation: the last chat call's messages plus its reply; None when the last call was a
/v1/completions call) and `agent_output` (None when there is none), handed over on a copy of
the task under `REWARD_INPUTS_KEY` (envs/agent_trajectory.py) and passed like columns; each
Episode keeps them (`reward_inputs`) for group functions, which get them as lists, one entry
per episode (envs/episode.py).

With `agent.sandbox` the same `/bin/sh -c` runs inside bwrap with no network
(envs/agent_launch.py `SandboxLauncher`): the run's endpoint is a Unix socket serving its
session alone (`EpisodeSession.serve_unix`), reached inside at `SANDBOX_BASE_URL` through a
forwarder, and its work directory is seen at `SANDBOX_WORKDIR`. With `agent.sandbox_cgroup`
(the default) it also runs in a cgroup of its own (memory, pids, CPU); after the run the
launcher's `finish` reports what that cgroup saw and removes it, and a run that an OOM kill
ended is an "oom" failure (`Confinement`, envs/agent_launch.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slipstream.envs.agent_endpoint import AgentEndpoint, CallRecord, EpisodeSession
from slipstream.envs.agent_launch import (
    SANDBOX_BASE_URL,
    SANDBOX_WORKDIR,
    AgentProcess,
    Confinement,
    make_launcher,
)
from slipstream.envs.agent_trajectory import REWARD_INPUTS_KEY, final_messages, segments
from slipstream.envs.base import (
    Demonstration,
    EnvFactory,
    EnvUsage,
    EpisodeLimits,
    InfraError,
    Scorer,
    StepResult,
    score_components,
)
from slipstream.envs.episode import Episode
from slipstream.envs.python_tool import CALL_CLOSE, CALL_OPEN, OUT_CLOSE, OUT_OPEN, ToolTeacher
from slipstream.envs.single_turn import taskset_scorer
from slipstream.tasks import Task, TaskSet

if TYPE_CHECKING:
    from slipstream.config.agent import AgentConfig
    from slipstream.engine.base import Engine

log = logging.getLogger(__name__)

KILL_GRACE_S = 5.0


class AgentFailed(InfraError):
    """The agent's run failed (see the module docstring): re-run, never a reward."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class AgentStats:
    """Counters over a worker's agent episodes (thread-safe `add`); the worker reports them as
    `agent_<name>`."""

    episodes: int = 0
    """Agent runs that ended as trainable episodes."""
    samples: int = 0
    calls: int = 0
    """Model calls answered (all runs, failed ones too)."""
    rewritten: int = 0
    """Episodes whose calls did not all extend one sequence (the agent rewrote its history):
    they yielded several samples sharing the episode's reward."""
    exit_nonzero: int = 0
    timeout: int = 0
    no_calls: int = 0
    aborted: int = 0
    bad_requests: int = 0
    """Malformed requests to the endpoint (answered 400)."""
    refused_calls: int = 0
    """Calls refused: past max_calls or the token budget, or after the episode ended."""
    oom: int = 0
    """Sandboxed runs that failed after the kernel OOM-killed a process of their cgroup
    (agent.sandbox_memory_mib)."""
    pids_limited: int = 0
    """Sandboxed runs in which a fork or thread start was refused at agent.sandbox_pids_max."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)

    def as_dict(self) -> dict[str, float]:
        with self._lock:
            return {k: float(v) for k, v in vars(self).items() if not k.startswith("_")}


@dataclass
class AgentRun:
    """What one run of the agent left: its exit, its output, the endpoint's record."""

    exit_code: int | None
    timed_out: bool
    aborted: bool
    stdout: str
    stderr: str
    output: Any
    """The agent's result file, else its stdout when that is JSON, else None."""
    calls: list[CallRecord]
    wall_s: float
    confinement: Confinement = field(default_factory=Confinement)
    """What the run's cgroup saw (a sandboxed run with `agent.sandbox_cgroup`)."""


class AgentRuntime:
    """What a worker's agent episodes share: the endpoint, the config, the counters."""

    def __init__(
        self,
        engine: Engine,
        taskset: TaskSet,
        cfg: AgentConfig,
        limits: EpisodeLimits,
        *,
        scorer: Scorer | None = None,
        temperature: float = 1.0,
        record_routing: bool = False,
        context_tokens: int = 0,
    ) -> None:
        if not cfg.command.strip():
            raise ValueError('task.env = "agent" needs agent.command (the program to run)')
        self.taskset = taskset
        self.cfg = cfg
        self.limits = limits
        self.scorer = scorer or taskset_scorer(taskset)
        self.max_calls = cfg.max_calls or limits.max_turns
        self.max_sampled_tokens = cfg.max_sampled_tokens or self.max_calls * limits.max_turn_tokens
        self.cwd = os.getcwd()  # `{cwd}` in agent.command: where the job was started
        # first, before the endpoint's threads: with agent.preload this spawns the template
        # (and fails here, naming the module, when a preload module does not import)
        self.launcher = make_launcher(cfg, self.cwd)
        try:
            self.endpoint = AgentEndpoint(
                engine, taskset.tokenizer, temperature=temperature,
                max_turn_tokens=limits.max_turn_tokens, context_tokens=context_tokens,
                record_routing=record_routing,
            )  # fmt: skip
        except BaseException:
            self.launcher.close()
            raise
        self.stats = AgentStats()
        self.slots = threading.BoundedSemaphore(cfg.max_concurrent or 2 * (os.cpu_count() or 1))

    def factory(self) -> EnvFactory:
        def make() -> AgentEnv:
            return AgentEnv(self.taskset, runtime=self)

        return make

    def close(self) -> None:
        self.endpoint.close()
        self.launcher.close()

    # ---- one run -------------------------------------------------------------------------------

    def environment(self, session: EpisodeSession, home: str) -> dict[str, str]:
        """The run's environment; a sandboxed run's HOME and OPENAI_BASE_URL are as it sees
        them inside (its work directory at SANDBOX_WORKDIR, the forwarder's URL)."""
        sandboxed = self.cfg.sandbox
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
            "HOME": SANDBOX_WORKDIR if sandboxed else home, **self.cfg.env,
            "OPENAI_BASE_URL": SANDBOX_BASE_URL if sandboxed else session.base_url,
            "OPENAI_API_KEY": session.api_key, "OPENAI_MODEL": self.endpoint.model_name,
            "NO_PROXY": "127.0.0.1,localhost",
        }  # fmt: skip

    def run_agent(
        self, task: Task, session: EpisodeSession, stopped: Callable[[], bool]
    ) -> AgentRun:
        """Run the agent once against `session` (see the module docstring)."""
        root = Path(tempfile.mkdtemp(prefix="slipstream-agent-"))
        work = root / "work"
        work.mkdir()
        sock: str | None = None
        try:
            if self.cfg.sandbox:  # its episode alone, on a socket bound into the sandbox
                (root / "endpoint").mkdir()
                sock = str(root / "endpoint" / "sock")
                session.serve_unix(sock)
            (root / "stdin.json").write_text(json.dumps(task.to_dict()))
            t0 = time.monotonic()
            deadline = t0 + self.cfg.timeout_s
            with (
                open(root / "stdin.json", "rb") as stdin,
                open(root / "stdout", "wb") as out,
                open(root / "stderr", "wb") as err,
            ):
                proc = self.launcher.start(stdin=stdin, stdout=out, stderr=err, cwd=str(work),
                                           env=self.environment(session, str(work)),
                                           endpoint_socket=sock)  # fmt: skip
                timed_out = aborted = False
                try:
                    while True:
                        try:
                            proc.wait(timeout=0.05)
                            break
                        except subprocess.TimeoutExpired:
                            pass
                        if time.monotonic() > deadline:
                            timed_out = True
                            break
                        if stopped():
                            aborted = True
                            break
                finally:
                    try:
                        _kill_group(proc)
                    finally:  # its cgroup (a sandboxed run): read, emptied, removed
                        confinement = self.launcher.finish(proc)
            session.close()  # calls still in flight are aborted, none recorded after this
            exit_code = None if (timed_out or aborted) else proc.returncode
            cap = self.cfg.max_output_bytes
            stdout = _head(root / "stdout", cap)
            return AgentRun(exit_code, timed_out, aborted, stdout, _head(root / "stderr", cap),
                            self._output(work, stdout), list(session.calls),
                            time.monotonic() - t0, confinement)  # fmt: skip
        finally:
            session.close()
            shutil.rmtree(root, ignore_errors=True)

    def _output(self, work: Path, stdout: str) -> Any:
        path = work / self.cfg.result_file
        if path.is_file() and not path.is_symlink():
            try:
                return json.loads(_head(path, self.cfg.max_output_bytes))
            except ValueError:
                return None
        try:
            return json.loads(stdout) if stdout.strip() else None
        except ValueError:
            return None

    def episodes(self, task: Task, run: AgentRun, session: EpisodeSession) -> list[Episode]:
        """The run's samples, rewarded; AgentFailed when the run failed."""
        st = self.stats
        st.add(calls=len(run.calls), bad_requests=session.bad_requests,
               refused_calls=session.refused)  # fmt: skip
        tail = run.stderr.strip().splitlines()[-1:] or [""]
        limits = run.confinement
        st.add(pids_limited=int(limits.pids_max_hits > 0))
        if run.aborted:
            st.add(aborted=1)
            return []
        if limits.oom_kills and (run.timed_out or run.exit_code != 0):
            # an OOM kill is the reason, whatever the exit: never scored (failed_exit_is_failure)
            st.add(oom=1)
            raise AgentFailed("oom", f"the agent's sandbox ran out of memory: {limits.oom_kills} "
                                     f"process(es) OOM-killed at agent.sandbox_memory_mib = "
                                     f"{self.cfg.sandbox_memory_mib} (exit {run.exit_code})")  # fmt: skip
        if run.timed_out:
            st.add(timeout=1)
            raise AgentFailed(
                "timeout", f"agent ran past agent.timeout_s = {self.cfg.timeout_s:g} s"
            )
        if run.exit_code != 0 and self.cfg.failed_exit_is_failure:
            st.add(exit_nonzero=1)
            raise AgentFailed("exit", f"agent exited with status {run.exit_code}: {tail[0][:200]}")
        segs = segments([(c.prompt_ids, c.completion) for c in run.calls])
        if not segs:
            st.add(no_calls=1)
            raise AgentFailed("no_calls", "agent ended without a model call that sampled a token "
                                          f"(exit {run.exit_code}; {len(run.calls)} calls)")  # fmt: skip
        last = run.calls[-1]
        answer = last.reply.get("content", "") if last.kind == "chat" else last.completion.text
        # reward functions' extra inputs ride on a copy of the task, read like its columns
        # (rewards/rewardset.py `reward_inputs`): the Scorer seam stays (task, completion)
        messages = final_messages(last.messages, last.reply) if last.kind == "chat" else None
        extra = {"messages": messages, "agent_output": run.output}
        scored = Task(task.task_id, task.prompt, task.key,
                      {**task.meta, REWARD_INPUTS_KEY: extra})  # fmt: skip
        score = self.scorer(scored, answer)  # the worker's Verifier: [[reward.functions]]
        reward, reason = score
        components = score_components(score)
        tok = self.taskset.tokenizer
        out = [
            Episode(
                prompt_ids=s.prompt_ids, completion_ids=s.completion_ids, loss_mask=s.loss_mask,
                logprobs=s.logprobs, versions=s.versions, reward=float(reward), reason=reason,
                finish_reason=s.finish_reason, text=tok.decode(s.completion_ids),
                num_turns=s.num_calls, routed_experts=s.routed_experts(),
                prefill_tokens=len(s.prompt_ids), env_s=run.wall_s,
                reward_components=dict(components), reward_inputs=extra,
            )
            for s in segs
        ]  # fmt: skip
        st.add(episodes=1, samples=len(out), rewritten=int(len(out) > 1))
        return out


class AgentEnv:
    """One agent episode, driven by `run`, not turn by turn. Built by `AgentRuntime.factory`;
    `make_env_factory` builds one without a runtime, for SFT demonstrations only."""

    stop: tuple[str, ...] = ()
    needs_sandbox = False

    def __init__(self, taskset: TaskSet, *, runtime: AgentRuntime | None = None,
                 scorer: Scorer | None = None, sandboxes: Any = None,
                 limits: EpisodeLimits | None = None) -> None:  # fmt: skip
        self.taskset = taskset
        self._runtime = runtime
        self.usage = EnvUsage()
        self.last_run: AgentRun | None = None

    @property
    def runtime(self) -> AgentRuntime:
        if self._runtime is None:
            raise RuntimeError("an agent episode needs the worker's AgentRuntime (this "
                               "environment was built for demonstrations only)")  # fmt: skip
        return self._runtime

    def reset(self, task: Task) -> list[int]:
        """The task's prompt ids (a placeholder: the agent's calls make the samples' prompts)."""
        self.runtime  # noqa: B018 - refuse an episode without a runtime at its start
        return self.taskset.prompt_ids(task)

    def step(self, action_ids: Sequence[int], *, last: bool) -> StepResult:
        raise RuntimeError("an agent episode is driven by its agent (AgentEnv.run), not by step")

    def run(self, task: Task, stopped: Callable[[], bool]) -> list[Episode]:
        rt = self.runtime
        while not rt.slots.acquire(timeout=0.1):  # agent.max_concurrent
            if stopped():
                return []
        try:
            session = rt.endpoint.open(max_calls=rt.max_calls,
                                       max_sampled_tokens=rt.max_sampled_tokens)  # fmt: skip
            run = rt.run_agent(task, session, stopped)
        finally:
            rt.slots.release()
        self.last_run = run
        out = run.output
        if isinstance(out, dict) and type(out.get("tool_calls")) is int and out["tool_calls"] >= 0:
            self.usage.tool_calls = out["tool_calls"]  # the agent's own count, for the metrics
        return rt.episodes(task, run, session)

    def demonstration(self, task: Task) -> Demonstration:
        """The task's demonstration as the agent's first call would see it (the task's prompt as
        the one user message). A task set with a tool teacher (`ToolTeacher`: tool_arithmetic)
        gets, where its teacher uses the tool, the exchange of examples/agents/calculator_agent.py:
        the call `<py>PROGRAM</py>` (trained on), the chat template's close of that reply and
        the next user message `<out>STDOUT</out>` (masked), then the answer. Where the template
        does not render that exchange as an extension of the first prompt, or the task set has
        no teacher, the plain demonstration."""
        ts, tok = self.taskset, self.taskset.tokenizer
        prompt = ts.prompt_ids(task)
        answer = ts.completion_ids(ts.demonstration(task))
        demo = ts.tool_demonstration(task) if isinstance(ts, ToolTeacher) else None
        if demo is None:
            return Demonstration(prompt, answer)
        program, stdout = demo
        user = [{"role": "user", "content": task.prompt}]
        call = tok.encode(CALL_OPEN + program + CALL_CLOSE)
        after = tok.chat_prompt([*user, {"role": "assistant", "content": CALL_OPEN + program + CALL_CLOSE},
                                 {"role": "user", "content": OUT_OPEN + stdout + OUT_CLOSE}])  # fmt: skip
        if tok.chat_prompt(user) != prompt or after[: len(prompt) + len(call)] != prompt + call:
            return Demonstration(prompt, answer)
        obs = after[len(prompt) + len(call) :]
        return Demonstration(prompt, call + obs + answer,
                             [1] * len(call) + [0] * len(obs) + [1] * len(answer))  # fmt: skip

    def close(self) -> None:
        """Nothing held between runs (each run closes its session and kills its processes)."""


def _kill_group(proc: AgentProcess) -> None:
    """SIGKILL the agent's whole process group (it leads its own session) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not ignorable
        log.error("agent process %d did not die after SIGKILL", proc.pid)


def _head(path: Path, cap: int) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(cap).decode("utf-8", "replace")
    except OSError:
        return ""
