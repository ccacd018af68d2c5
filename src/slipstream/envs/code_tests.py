"""`code_tests`: the `code` task as a multi-turn episode: write a solution, see it run against the
visible tests in the episode's sandbox, revise.

    prompt:   the code problem + "Visible tests:" + `add(1, 2) == 3` lines
    turn k:   a solution (a ```python block), ended by EOS
    step:     the solution runs against the visible tests in the episode's sandbox
              (code.py's harness: expected values stay on the host);
              all pass, or no turn may follow -> done, reward = hidden-test pass fraction
              (code.py's verify_code, in the same sandbox); else the observation is
              `<out>visible tests: 1/2 passed` + the failures (got/expected, errors) + `</out>`
              and the policy revises

Visible tests are the first `VISIBLE` tests of the problem (at least one test stays hidden);
the hidden reward counts all of them, as the single-turn `code` task does. A turn without a code
block gets "no ```python block" as its observation. A sandbox that dies during a run (the guest
agent is gone) is an InfraError (the episode is re-run), also when the candidate killed it: a
candidate cannot earn a zero by breaking its sandbox, but its task is dropped after
`max_infra_retries`.

Demonstrations: the reference solution in one turn (the teacher passes the visible tests at once).
Not covered: per-test timeouts (one timeout per run), partial credit across turns, tests that
need files or stdin.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from slipstream.envs.base import (
    Demonstration,
    EnvUsage,
    EpisodeLimits,
    InfraError,
    Scorer,
    StepResult,
    encode_observation,
)
from slipstream.envs.python_tool import OUT_CLOSE, OUT_OPEN, observation_text
from slipstream.tasks import Task, TaskSet
from slipstream.tasks.code import (
    BY_NAME,
    CodeProblem,
    expected,
    extract_code,
    run_harness,
    same_value,
    verify_code,
)

if TYPE_CHECKING:
    from slipstream.envs.sandboxes import HeldSandbox, SandboxHost
    from slipstream.sandbox import Sandbox

VISIBLE = 2


def visible_count(problem: CodeProblem) -> int:
    return max(1, min(VISIBLE, len(problem.tests) - 1))


def call_text(problem: CodeProblem, args: tuple[Any, ...]) -> str:
    return f"{problem.name}({', '.join(ascii(a) for a in args)})"


def prompt_text(problem: CodeProblem) -> str:
    lines = [f"  {call_text(problem, args)} == {ascii(want)}"
             for args, want in zip(problem.tests, expected(problem), strict=False)]  # fmt: skip
    return problem.prompt + "Visible tests:\n" + "\n".join(lines[: visible_count(problem)]) + "\n"


async def run_visible(problem: CodeProblem, source: str, sb: Sandbox,
                      timeout_s: float) -> str:  # fmt: skip
    """Run `source` against the visible tests in `sb` (code.py's harness); -> a report of what
    failed. SandboxBroken (a dead sandbox) propagates; everything the candidate does is in the
    report (results it made unreadable count as no results)."""
    n = visible_count(problem)
    run = await run_harness(problem, source.encode("utf-8", "replace"), sb, num_tests=n,
                            timeout_s=timeout_s, run_prefix="visible")  # fmt: skip
    if run.load_error is not None:
        return f"does not load: {run.load_error[:120]}\n"
    want = expected(problem)[:n]
    failures, passed = [], 0
    for i in range(n):
        rec = run.records.get(i, {})
        if "value" in rec and same_value(rec["value"], want[i]):
            passed += 1
        elif "value" in rec:
            failures.append(f"{call_text(problem, problem.tests[i])}: expected {ascii(want[i])}, "
                            f"got {ascii(rec['value'])[:40]}")  # fmt: skip
        else:
            failures.append(f"{call_text(problem, problem.tests[i])}: "
                            f"{rec.get('error', 'no result')}")  # fmt: skip
    status = " (timed out)" if run.result.timed_out else ""
    return f"visible tests: {passed}/{n} passed{status}\n" + "".join(f + "\n" for f in failures)


class CodeTestsEnv:
    stop: tuple[str, ...] = ()
    needs_sandbox = True

    def __init__(self, taskset: TaskSet, *, scorer: Scorer | None = None,
                 sandboxes: SandboxHost | None = None,
                 limits: EpisodeLimits | None = None) -> None:  # fmt: skip
        if taskset.name != "code":
            raise ValueError(
                f"task.env = 'code_tests' needs task.name = 'code', got {taskset.name!r}"
            )
        self.taskset = taskset
        self.sandboxes = sandboxes
        self.limits = limits or EpisodeLimits()
        self.usage = EnvUsage()
        self._problem: CodeProblem | None = None
        self._held: HeldSandbox | None = None

    def _prompt_ids(self, task: Task) -> list[int]:
        problem = BY_NAME[task.meta["problem"]]
        tok = self.taskset.tokenizer
        return [tok.bos_id, *tok.encode(prompt_text(problem))]

    def reset(self, task: Task) -> list[int]:
        if self.sandboxes is None:
            raise InfraError("code_tests environment: no sandbox host was given")
        self.close()
        self._problem = BY_NAME[task.meta["problem"]]
        self._held = self.sandboxes.acquire()
        self.usage.sandbox_acquire_s = self._held.acquire_s
        return self._prompt_ids(task)

    def step(self, action_ids: Sequence[int], *, last: bool) -> StepResult:
        problem, held = self._problem, self._held
        if problem is None or held is None:
            raise RuntimeError("CodeTestsEnv.step before reset")
        source = extract_code(self.taskset.tokenizer.decode(action_ids))
        timeout_s = self.limits.turn_timeout_s
        cap = self.limits.max_observation_tokens
        if not source.strip() and not last:
            text = observation_text("no ```python block found\n", max_chars=cap)
            return StepResult(encode_observation(self.taskset.tokenizer, text, cap), 0.0, False,
                              "no code")  # fmt: skip
        report = ""
        if not last:
            t0 = time.monotonic()
            report = held.run(lambda sb: run_visible(problem, source, sb, timeout_s),
                              timeout_s + 40.0, "visible tests")  # fmt: skip
            self.usage.tool_calls += 1
            self.usage.tool_s += time.monotonic() - t0
        if last or report.startswith(f"visible tests: {visible_count(problem)}/"):

            async def hidden(sb: Sandbox) -> tuple[float, str]:
                verdict = await verify_code(problem, source, sb, timeout_s=timeout_s)
                if verdict.reason.startswith("sandbox failure"):
                    await sb.ping()  # SandboxBroken when the sandbox died: infrastructure
                return verdict.reward, verdict.reason

            reward, reason = held.run(hidden, timeout_s + 40.0, "hidden tests")
            return StepResult([], reward, True, reason)
        body = report[: cap - len(OUT_OPEN) - len(OUT_CLOSE)]
        return StepResult(encode_observation(self.taskset.tokenizer,
                                             OUT_OPEN + body + OUT_CLOSE, cap),
                          0.0, False, report.split("\n", 1)[0])  # fmt: skip

    def demonstration(self, task: Task) -> Demonstration:
        ts = self.taskset
        return Demonstration(self._prompt_ids(task), ts.completion_ids(ts.demonstration(task)))

    def close(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            held.release()
