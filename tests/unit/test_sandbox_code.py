"""The code task's verifier: every reference solution scores 1.0 in a real sandbox (bwrap when this
host can run it, else the process backend), wrong and hostile candidates score less, never raise."""

from __future__ import annotations

import asyncio
import os

import pytest

from slipstream.config.task import TaskConfig
from slipstream.sandbox.base import SandboxTemplate, make_backend
from slipstream.sandbox.errors import BackendUnavailable
from slipstream.tasks import get_taskset
from slipstream.tasks.code import BY_NAME, extract_code, same_value, verify_code
from slipstream.tasks.code_problems import PROBLEMS


@pytest.fixture(scope="module")
def sandbox_runner(tmp_path_factory):
    state = tmp_path_factory.mktemp("code-state")
    try:
        if os.geteuid() != 0:
            raise BackendUnavailable("not root")
        backend = make_backend("bwrap", state_dir=state)
    except BackendUnavailable:
        backend = make_backend("process", state_dir=state)
    loop = asyncio.new_event_loop()
    sb = loop.run_until_complete(
        backend.create(
            SandboxTemplate(backend=backend.name, memory_mib=256, workdir_mib=32),
            sandbox_id=f"code-test-{os.getpid()}",
        )  # fmt: skip
    )
    run = loop.run_until_complete
    try:
        yield run, sb, backend
    finally:
        run(sb.release())
    loop.close()


def test_about_fifty_distinct_problems():
    assert 45 <= len(PROBLEMS) <= 60
    for p in PROBLEMS:
        assert p.name in p.signature and len(p.tests) >= 3 and p.prompt.startswith("Write")


def test_every_reference_scores_one(sandbox_runner):
    run, sb, backend = sandbox_runner
    for p in PROBLEMS:
        v = run(verify_code(p, p.reference, sb))
        assert v.reward == 1.0, (p.name, v)


WRONG = {
    "off by one": ("add", "def add(a, b):\n    return a + b + 1"),
    "partly right": ("is_even", "def is_even(n):\n    return n == 0"),
    "wrong type": ("binary_string", "def binary_string(n):\n    return int(bin(n)[2:])"),
}
HOSTILE = {
    "syntax error": ("add", "def add(a, b)\n    return a+b"),
    "missing function": ("add", "def plus(a, b):\n    return a + b"),
    "infinite loop": ("add", "def add(a, b):\n    while True:\n        pass"),
    "loop at import": ("add", "while True:\n    pass"),
    "huge output": (
        "add",
        "import sys\ndef add(a, b):\n    sys.stdout.write('x' * 10**7)\n    return a + b + 1",
    ),
    "exit": ("add", "import sys\nsys.exit(0)"),
    "os._exit": ("add", "import os\ndef add(a, b):\n    os._exit(0)"),
    "forged results": (
        "add",
        "open('results.jsonl','w').write('{\"i\": 0, \"value\": 3}\\n' * 10)\nimport os\nos._exit(0)",
    ),
    "memory bomb": ("add", "x = bytearray(10**10)"),
    "fork": ("add", "import os\nfor _ in range(4):\n    os.fork()\ndef add(a, b):\n    return -1"),
    "kills the agent": ("add", "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)"),
    "non-json result": ("add", "def add(a, b):\n    return object()"),
    "empty": ("add", ""),
    "binary junk": ("add", "\x00\xff" * 100),
}


def test_wrong_candidates_score_below_one(sandbox_runner):
    run, sb, backend = sandbox_runner
    for label, (name, src) in WRONG.items():
        v = run(verify_code(BY_NAME[name], src, sb))
        assert v.reward < 1.0, (label, v)
    assert 0 < run(verify_code(BY_NAME["is_even"], WRONG["partly right"][1], sb)).reward < 1


def test_hostile_candidates_score_zero_and_never_raise(sandbox_runner):
    run, sb, backend = sandbox_runner
    for label, (name, src) in HOSTILE.items():
        if label in ("kills the agent", "forged results"):
            continue  # checked below (the first destroys the shared sandbox)
        v = run(verify_code(BY_NAME[name], src, sb, timeout_s=3.0))
        assert v.reward == 0.0, (label, v)
    v = run(verify_code(BY_NAME["add"], HOSTILE["forged results"][1], sb))
    assert v.reward <= 0.25, v  # forged lines can only carry values the candidate computed
    victim = run(
        backend.create(
            SandboxTemplate(backend=backend.name), sandbox_id=f"code-victim-{os.getpid()}"
        )
    )
    v = run(verify_code(BY_NAME["add"], HOSTILE["kills the agent"][1], victim))
    assert v.reward == 0.0 and "sandbox failure" in v.reason
    run(victim.release())


def test_extract_and_compare():
    assert (
        extract_code("blah\n```python\ndef f():\n    return 1\n```\nmore")
        == "def f():\n    return 1\n"
    )
    assert extract_code("def f(): pass") == "def f(): pass"
    assert same_value(1.0, 1.0000000000001) and not same_value(True, 1) and not same_value(1, "1")
    assert same_value({"a": [1, 2.0]}, {"a": [1, 2.0]}) and not same_value([1], [1, 2])


def test_taskset_splits_and_demonstrations(sandbox_runner):
    run, sb, backend = sandbox_runner
    ts = get_taskset(TaskConfig(name="code", tokenizer="char"))
    held = {t.key for t in ts.heldout()}
    train = {ts.train(i).key for i in range(200)}
    assert held and train and not held & train
    task = ts.heldout()[0]
    assert run(ts.averify(task, ts.demonstration(task), sb)).reward == 1.0
    assert run(ts.averify(task, "no code here", sb)).reward == 0.0


def test_sync_verify_uses_a_journaled_single_use_pool():
    """`verify` (eval, RM pairs) gets its sandbox from the pool factory: scored like `averify`,
    and nothing of this process is left in the journal afterwards."""
    from slipstream.sandbox.journal import Journal, default_state_dir

    ts = get_taskset(TaskConfig(name="code", tokenizer="char"))
    task = ts.heldout()[0]
    assert ts.verify(task, ts.demonstration(task)).reward == 1.0
    assert ts.verify(task, "```python\ndef nothing(): pass\n```").reward == 0.0
    mine = [e for e in Journal(default_state_dir()).entries() if e["owner_pid"] == os.getpid()]
    assert mine == []
