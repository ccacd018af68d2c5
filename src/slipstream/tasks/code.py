"""The built-in `code` task: write a Python function; reward = fraction of hidden tests passed, run
inside a sandbox.

    verdict = await verify_code(problem, candidate_source, sandbox)   # any slipstream Sandbox
    ts = make_taskset(cfg, tokenizer); ts.verify(task, completion)    # sync: a fresh sandbox per call
    await ts.averify(task, completion, sandbox)                       # the RL loop, with a pool

How a candidate is judged: the sandbox receives the candidate (`solution.py`), the test *inputs*
and a small harness; the harness calls the function on each input and writes one JSON line per
test. The expected outputs are computed on the host from the reference solutions and never enter
the sandbox, so a hostile candidate can only "pass" a test by producing the right value. Infinite
loops hit the exec timeout (tests finished before it still count), huge output is capped by the
sandbox, syntax errors and missing functions score 0 with a reason. The results file is read
only when it is a regular file of at most MAX_RESULTS_BYTES, within min(timeout, 5 s): a
candidate that replaces it with a FIFO, a device, a symlink out or a directory scores 0
("results unreadable") at once instead of stalling verification.

Not covered: per-test timeouts (one timeout covers all tests of a problem), resource accounting in
the reward (only correctness counts).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import secrets
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from slipstream.sandbox.errors import BackendUnavailable, SandboxBroken, SandboxError
from slipstream.tasks.base import SandboxedTaskSet, Task, Verdict, keyed_uniform
from slipstream.tasks.code_problems import PROBLEMS, CodeProblem

if TYPE_CHECKING:
    from slipstream.config.task import TaskConfig
    from slipstream.model.tokenizer import Tokenizer
    from slipstream.sandbox.base import ExecResult, Sandbox

log = logging.getLogger(__name__)
MAX_SOURCE_BYTES = 100_000
MAX_RESULTS_BYTES = 4 << 20
RESULTS_READ_TIMEOUT_S = 5.0  # reading <= 4 MiB from the work dir takes milliseconds
DEFAULT_TIMEOUT_S = 10.0
BY_NAME = {p.name: p for p in PROBLEMS}

# Runs inside the sandbox with the sandbox's python3. Catches everything the candidate raises
# (including SystemExit) so that one bad test does not hide the others.
HARNESS = r"""
import json, sys
sys.setrecursionlimit(10000)
name = sys.argv[1]
tests = json.load(open("tests.json"))
out = open("results.jsonl", "w", buffering=1)
try:
    ns = {"__name__": "solution"}
    exec(compile(open("solution.py").read(), "solution.py", "exec"), ns)
    fn = ns[name]
except BaseException as e:
    out.write(json.dumps({"load_error": (type(e).__name__ + ": " + str(e))[:300]}) + "\n")
    raise SystemExit(0)
for i, args in enumerate(tests):
    try:
        value = fn(*args)
        try:
            line = json.dumps({"i": i, "value": value})
        except (TypeError, ValueError, RecursionError):
            line = json.dumps({"i": i, "error": "result is not JSON-serialisable"})
    except BaseException as e:
        line = json.dumps({"i": i, "error": type(e).__name__})
    out.write(line + "\n")
"""

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|\Z)", re.S)


def extract_code(completion: str) -> str:
    """The first fenced code block of a completion, else the whole text."""
    m = _FENCE.search(completion)
    return m.group(1) if m else completion


def expected_outputs(problem: CodeProblem) -> list[Any]:
    """Reference outputs, JSON-normalised (tuples become lists), computed on the host."""
    ns: dict[str, Any] = {}
    exec(compile(problem.reference, f"<reference {problem.name}>", "exec"), ns)  # trusted source
    fn = ns[problem.name]
    return [json.loads(json.dumps(fn(*args))) for args in problem.tests]


_expected_cache: dict[str, list[Any]] = {}


def expected(problem: CodeProblem) -> list[Any]:
    """`expected_outputs(problem)`, computed once per problem and process."""
    if problem.name not in _expected_cache:
        _expected_cache[problem.name] = expected_outputs(problem)
    return _expected_cache[problem.name]


def same_value(got: Any, want: Any) -> bool:
    """Equality of JSON values with a float tolerance (1e-9 relative/absolute); bool != int."""
    if isinstance(want, bool) or isinstance(got, bool):
        return type(got) is type(want) and got == want
    if isinstance(want, float) or isinstance(got, float):
        return (
            isinstance(got, int | float)
            and isinstance(want, int | float)
            and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)
        )
    if isinstance(want, list):
        return (
            isinstance(got, list)
            and len(got) == len(want)
            and all(same_value(g, w) for g, w in zip(got, want, strict=True))
        )
    if isinstance(want, dict):
        return (
            isinstance(got, dict)
            and got.keys() == want.keys()
            and all(same_value(got[k], want[k]) for k in want)
        )
    return type(got) is type(want) and got == want


@dataclass
class HarnessRun:
    """What one run of the harness left: the exec result, the first record per test index
    (`{"i", "value"}` or `{"i", "error"}`), the candidate's load error, or why the results file
    could not be read (the candidate replaced or removed it; then there are no records)."""

    result: ExecResult
    records: dict[int, dict[str, Any]] = field(default_factory=dict)
    load_error: str | None = None
    unreadable: str | None = None


async def run_harness(
    problem: CodeProblem, source: bytes, sandbox: Sandbox, *, num_tests: int, timeout_s: float,
    run_prefix: str,
) -> HarnessRun:  # fmt: skip
    """Run `source` against the first `num_tests` test inputs of `problem` in `sandbox`, in a
    fresh dir `<run_prefix>-<random>` of its work dir. The expected outputs never enter the
    sandbox. SandboxError from the exec and SandboxBroken from reading the results propagate
    (a broken sandbox); everything the candidate does is in the returned run."""
    run_dir = f"{run_prefix}-{secrets.token_hex(4)}"
    files = {
        f"{run_dir}/solution.py": source,
        f"{run_dir}/tests.json": json.dumps([list(t) for t in problem.tests[:num_tests]]).encode(),
        f"{run_dir}/harness.py": HARNESS.encode(),
    }
    result = await sandbox.exec(
        ["python3", "-I", "-S", "harness.py", problem.name],
        files=files,
        timeout_s=timeout_s,
        cwd=run_dir,
    )
    run = HarnessRun(result)
    try:
        # Regular files only (a FIFO, device or symlink the candidate put there is refused by
        # the agent without blocking), capped, and bounded in time by the exec timeout.
        raw = await sandbox.get_file(
            f"{run_dir}/results.jsonl",
            timeout_s=min(timeout_s, RESULTS_READ_TIMEOUT_S),
            max_bytes=MAX_RESULTS_BYTES,
        )
    except SandboxBroken:
        raise
    except SandboxError as e:  # missing, too large, or not a regular file: the candidate's doing
        run.unreadable = str(e)
        return run
    for line in raw.decode("utf-8", "replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(rec, dict):
            continue
        if "load_error" in rec:
            run.load_error = str(rec["load_error"])
            return run
        i = rec.get("i")
        if isinstance(i, int) and 0 <= i < num_tests and i not in run.records:
            run.records[i] = rec
    return run


async def verify_code(
    problem: CodeProblem,
    candidate_source: str,
    sandbox: Sandbox,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Verdict:
    """Run the candidate against the problem's hidden tests in `sandbox`; reward = pass fraction.
    Never raises for anything the candidate does; SandboxError from a broken sandbox is turned into
    reward 0 with the reason (the caller should destroy that sandbox)."""
    source = candidate_source.encode("utf-8", "replace")
    if len(source) > MAX_SOURCE_BYTES:
        return Verdict(0.0, f"candidate is {len(source)} bytes (> {MAX_SOURCE_BYTES})")
    if not source.strip():
        return Verdict(0.0, "empty candidate")
    want = expected(problem)
    try:
        run = await run_harness(problem, source, sandbox, num_tests=len(want),
                                timeout_s=timeout_s, run_prefix="run")  # fmt: skip
    except SandboxError as e:
        return Verdict(0.0, f"sandbox failure: {str(e)[:200]}")
    if run.unreadable is not None:
        return Verdict(0.0, f"results unreadable: {run.unreadable[:200]}")
    if run.load_error is not None:
        return Verdict(0.0, f"does not load: {run.load_error[:200]}")
    got, result = run.records, run.result
    passed = sum(
        1
        for i, w in enumerate(want)
        if "value" in got.get(i, {}) and same_value(got[i]["value"], w)
    )
    frac = passed / len(want)
    if result.timed_out:
        why = f"timed out after {timeout_s} s"
    elif result.oom_killed:
        why = "out of memory"
    elif result.exit_code != 0:
        why = f"harness exit {result.exit_code}"
    else:
        errors = sorted({str(r["error"]) for r in got.values() if "error" in r})
        why = (
            f"errors: {', '.join(errors)[:100]}"
            if errors
            else ("all passed" if frac == 1 else "wrong answers")
        )
    return Verdict(frac, f"passed {passed}/{len(want)} ({why})")


class CodeTaskSet(SandboxedTaskSet):
    """The fixed problem list split into train/held-out by keyed hash of the problem name."""

    name = "code"

    def __init__(self, cfg: TaskConfig, tokenizer: Tokenizer, backend: str | None = None) -> None:
        super().__init__(cfg, tokenizer)
        held, train = [], []
        for p in PROBLEMS:
            (
                held if keyed_uniform(cfg.seed, "code", p.name) < cfg.heldout_fraction else train
            ).append(p)
        if not held:
            held.append(train.pop())
        self.train_problems = train
        self.heldout_problems = held[: cfg.num_heldout]
        self.backend_name = backend
        self._backend = None
        self._lock = threading.Lock()

    def _task(self, p: CodeProblem, split: str, index: int) -> Task:
        return Task(f"code/{split}/{index}", p.prompt, p.name, {"problem": p.name})

    def train(self, index: int) -> Task:
        if index < 0:
            raise IndexError(f"code: train index {index} is negative")
        index %= self.num_train
        return self._task(self.train_problems[index % len(self.train_problems)], "train", index)

    def heldout(self) -> list[Task]:
        return [self._task(p, "heldout", i) for i, p in enumerate(self.heldout_problems)]

    def demonstration(self, task: Task) -> str:
        return "```python\n" + BY_NAME[task.meta["problem"]].reference + "```\n"

    async def averify(self, task: Task, completion: str, sandbox: Sandbox) -> Verdict:
        problem = BY_NAME.get(task.meta.get("problem", ""))
        if problem is None:
            return Verdict(0.0, f"unknown code problem {task.meta!r:.100}")
        return await verify_code(problem, extract_code(completion), sandbox)

    def _get_backend(self):  # type: ignore[no-untyped-def]
        from slipstream.sandbox.base import make_backend

        with self._lock:
            if self._backend is None:
                name = self.backend_name or "bwrap"
                try:
                    self._backend = make_backend(name)
                except BackendUnavailable as e:
                    if self.backend_name is not None:
                        raise
                    log.warning("code task: bwrap unavailable (%s); falling back to the process "
                                "backend, which is NOT isolation", e)  # fmt: skip
                    self._backend = make_backend("process")
            return self._backend

    def verify(self, task: Task, completion: str) -> Verdict:
        """Sync verification in a fresh sandbox (eval, reward-model pairs; the RL loop uses
        `averify` with the worker's pool): a single-use pool of its own from the pool factory,
        on this task set's backend, so the sandbox is journaled like any other (what a crash
        leaves is reaped by the next pool that starts)."""
        from slipstream.sandbox import PoolOptions, SandboxTemplate, open_pool

        backend = self._get_backend()
        template = SandboxTemplate(backend=backend.name, memory_mib=256, workdir_mib=32)

        async def once() -> Verdict:
            async with open_pool(template, PoolOptions(min_idle=0, max_idle=0),
                                 backend=backend) as pool:  # fmt: skip
                async with pool.sandbox() as sb:
                    return await self.averify(task, completion, sb)

        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(once())
        box: list[Verdict] = []
        t = threading.Thread(target=lambda: box.append(asyncio.run(once())))
        t.start()
        t.join()
        return box[0] if box else Verdict(0.0, "verification failed")


def make_taskset(cfg: TaskConfig, tokenizer: Tokenizer) -> CodeTaskSet:
    return CodeTaskSet(cfg, tokenizer)
