"""`python_tool`: the task's prompt, then turns in which the policy may run Python in the
episode's sandbox before it answers.

Syntax (the char tokenizer can express it; the engine's stop string `</py>` ends the turn):

    347*286=<py>347*286</py><out>99242
    </out>99242<eos>

- A turn whose text ends with `</py>` and holds a `<py>` before it is a **tool call**: the code
  between the last `<py>` and the `</py>` is written to `cell<k>.py` in the sandbox's work dir
  and run with `python3 -I -S` (timeout `turn_timeout_s`) as a notebook cell: when its last
  statement is an expression, the expression's value is printed (`<py>347*286</py>` prints
  99242, as `<py>print(347*286)</py>` does); the observation is
  `<out>` + stdout + stderr + a status line (`[exit N]`, `[timed out]`, `[out of memory]`) +
  `</out>`, capped at `max_observation_tokens` (a third of the head, two thirds of the tail,
  `...` between).
- Any other turn (ended by EOS or the token cap), and any turn when no further turn may follow,
  is the **answer**: the scorer (the task's verifier) gets that turn's text.
- The sandbox is acquired at `reset` and kept until `close`, so files written by one cell are
  there for the next (state persists across turns; Python variables do not, each cell is a new
  process). Sandboxes are never shared by two episodes at once; whether a released one is
  destroyed or reset for the next episode is the pool's `sandbox.reuse` (see sandboxes.py for
  what is wiped).
- A sandbox that dies under a tool call (its guest agent gone) is an InfraError: the episode is
  re-run, never scored.
- Demonstrations: a task set that implements `ToolTeacher` (`tool_demonstration(task)` ->
  (program, its stdout) or None) gets tool-using demonstrations for the problems its teacher
  solves with the tool; the observation in them is exactly what this environment would append
  for that stdout, and it is masked out of the SFT loss. Other problems (and other task sets)
  get the task's plain demonstration.

Not covered: several tool calls in one turn (the last one runs), stdin for the program, network
(no sandbox has one), persistent interpreter state.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from slipstream.envs.base import (
    Demonstration,
    EnvUsage,
    EpisodeLimits,
    InfraError,
    Scorer,
    StepResult,
    encode_observation,
    score_components,
)
from slipstream.envs.single_turn import taskset_scorer
from slipstream.tasks import Task, TaskSet

if TYPE_CHECKING:
    from slipstream.envs.sandboxes import HeldSandbox, SandboxHost
    from slipstream.sandbox import ExecResult

CALL_OPEN, CALL_CLOSE = "<py>", "</py>"
# Runs cell<k>.py as a notebook cell: the value of a final expression statement is printed.
CELL_RUNNER = (
    "import ast,sys\n"
    "p=sys.argv[1];t=ast.parse(open(p).read(),p)\n"
    "e=t.body.pop() if t.body and isinstance(t.body[-1],ast.Expr) else None\n"
    "g={'__name__':'__main__'}\n"
    "exec(compile(t,p,'exec'),g)\n"
    "if e is not None:\n"
    " v=eval(compile(ast.Expression(e.value),p,'eval'),g)\n"
    " if v is not None:print(repr(v))\n"
)
OUT_OPEN, OUT_CLOSE = "<out>", "</out>"
ELLIPSIS = "..."


@runtime_checkable
class ToolTeacher(Protocol):
    """A task set whose SFT teacher sometimes uses the `<py>` tool."""

    def tool_demonstration(self, task: Task) -> tuple[str, str] | None:
        """(program, the stdout it prints) when the teacher uses the tool on `task`, else None
        (it answers without it)."""
        ...


def tool_call(text: str) -> str | None:
    """The program of a turn that ends with a tool call, else None."""
    if not text.endswith(CALL_CLOSE):
        return None
    body = text[: -len(CALL_CLOSE)]
    start = body.rfind(CALL_OPEN)
    if start < 0:
        return None
    return body[start + len(CALL_OPEN) :]


def observation_text(
    stdout: str, stderr: str = "", exit_code: int | None = 0, *, timed_out: bool = False,
    oom_killed: bool = False, max_chars: int = 64,
) -> str:  # fmt: skip
    """`<out>` + output + status + `</out>` in at most max_chars characters: when the output is
    longer, its first third and last two thirds of the room around `...` (the end of a
    traceback names the error)."""
    if timed_out:
        status = "[timed out]\n"
    elif oom_killed:
        status = "[out of memory]\n"
    elif exit_code != 0:
        status = f"[exit {exit_code}]\n"
    else:
        status = ""
    body = stdout + stderr
    room = max(0, max_chars - len(OUT_OPEN) - len(OUT_CLOSE) - len(status))
    if len(body) > room:
        keep = max(0, room - len(ELLIPSIS))
        head = keep // 3
        body = body[:head] + ELLIPSIS + (body[len(body) - (keep - head) :] if keep > head else "")
        body = body[:room]
    return OUT_OPEN + body + status + OUT_CLOSE


def result_observation(result: ExecResult, max_chars: int) -> str:
    return observation_text(result.stdout, result.stderr, result.exit_code,
                            timed_out=result.timed_out, oom_killed=result.oom_killed,
                            max_chars=max_chars)  # fmt: skip


class PythonToolEnv:
    stop: tuple[str, ...] = (CALL_CLOSE,)
    needs_sandbox = True

    def __init__(self, taskset: TaskSet, *, scorer: Scorer | None = None,
                 sandboxes: SandboxHost | None = None,
                 limits: EpisodeLimits | None = None) -> None:  # fmt: skip
        self.taskset = taskset
        self.scorer = scorer or taskset_scorer(taskset)
        self.sandboxes = sandboxes
        self.limits = limits or EpisodeLimits()
        self.usage = EnvUsage()
        self._task: Task | None = None
        self._held: HeldSandbox | None = None
        self._cells = 0

    def reset(self, task: Task) -> list[int]:
        if self.sandboxes is None:
            raise InfraError("python_tool environment: no sandbox host was given")
        self.close()
        self._task, self._cells = task, 0
        self._held = self.sandboxes.acquire()
        self.usage.sandbox_acquire_s = self._held.acquire_s
        return self.taskset.prompt_ids(task)

    def step(self, action_ids: Sequence[int], *, last: bool) -> StepResult:
        if self._task is None or self._held is None:
            raise RuntimeError("PythonToolEnv.step before reset")
        text = self.taskset.tokenizer.decode(action_ids)
        program = tool_call(text)
        if program is None or last:
            score = self.scorer(self._task, text)
            reward, reason = score
            return StepResult([], float(reward), True, reason, score_components(score))
        name = f"cell{self._cells}.py"
        self._cells += 1
        t0 = time.monotonic()
        result = self._held.exec(["python3", "-I", "-S", "-c", CELL_RUNNER, name],
                                 files={name: program},
                                 timeout_s=self.limits.turn_timeout_s)  # fmt: skip
        self.usage.tool_calls += 1
        self.usage.tool_s += time.monotonic() - t0
        cap = self.limits.max_observation_tokens
        ids = encode_observation(self.taskset.tokenizer, result_observation(result, cap), cap)
        return StepResult(ids, 0.0, False, "tool call")

    def demonstration(self, task: Task) -> Demonstration:
        ts, tok = self.taskset, self.taskset.tokenizer
        prompt = ts.prompt_ids(task)
        answer = ts.completion_ids(ts.demonstration(task))
        demo = ts.tool_demonstration(task) if isinstance(ts, ToolTeacher) else None
        if demo is None:
            return Demonstration(prompt, answer)
        program, stdout = demo
        call = tok.encode(CALL_OPEN + program + CALL_CLOSE)
        cap = self.limits.max_observation_tokens
        obs = encode_observation(tok, observation_text(stdout, max_chars=cap), cap)
        return Demonstration(prompt, call + obs + answer,
                             [1] * len(call) + [0] * len(obs) + [1] * len(answer))  # fmt: skip

    def close(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            held.release()
