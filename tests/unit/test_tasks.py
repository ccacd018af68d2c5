"""Built-in tasks: determinism, disjoint splits, verifier correctness, and hostile model output."""

from __future__ import annotations

import pytest

from slipstream.config.task import TaskConfig
from slipstream.tasks import Task, get_taskset
from slipstream.tasks.countdown import solve
from slipstream.tasks.expr import ExprError, parse_expression

NAMES = ["arithmetic", "countdown"]

HOSTILE = {
    "empty": "",
    "whitespace": "   \n\t ",
    "one megabyte": "7" * 1_000_000,
    "one megabyte of parens": "(" * 500_000 + ")" * 500_000,
    "power tower": "9**9**9",
    "division by zero": "1/0",
    "division by zero expr": "5/(3-3)",
    "deep parentheses": "(" * 100 + "1" + ")" * 100,
    "non-ascii digits": "١٢٣",
    "non-ascii": "8*3+5 ✓",
    "nul bytes": "\x00" * 100,
    "python code": "__import__('os').system('true')",
    "huge literal": "1" * 50,
    "huge product": "999999*999999*999999*999999",
    "float": "1e308",
    "unary minus": "-5",
    "dangling operator": "3+",
    "unbalanced": "((3+4)",
}


def _cfg(name: str, **kw) -> TaskConfig:
    kw.setdefault("num_heldout", 100)
    return TaskConfig(name=name, **kw)


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_for_seed_and_different_across_seeds(name: str) -> None:
    a, b = get_taskset(_cfg(name)), get_taskset(_cfg(name))
    assert [t.prompt for t in a.heldout()] == [t.prompt for t in b.heldout()]
    assert [a.train(i) for i in range(50)] == [b.train(i) for i in range(50)]
    assert a.train(7) == a.train(7 + a.num_train)  # wraps at num_train
    c = get_taskset(_cfg(name, seed=99))
    assert [t.prompt for t in c.train_batch(0, 20)] != [t.prompt for t in a.train_batch(0, 20)]


@pytest.mark.parametrize("name", NAMES)
def test_splits_are_disjoint_and_heldout_distinct(name: str) -> None:
    ts = get_taskset(_cfg(name))
    heldout = ts.heldout()
    assert len(heldout) == 100
    held_keys = {t.key for t in heldout}
    assert len(held_keys) == 100
    train_keys = {ts.train(i).key for i in range(3000)}
    assert not held_keys & train_keys
    assert len({t.task_id for t in heldout}) == 100


def test_split_disjoint_on_small_problem_space() -> None:
    # 1-digit addition has 100 problems: many collisions, so disjointness is really exercised.
    ts = get_taskset(
        _cfg("arithmetic", max_digits=1, ops=["+"], num_heldout=5, heldout_fraction=0.2)
    )
    held = {t.key for t in ts.heldout()}
    train = {ts.train(i).key for i in range(2000)}
    assert len(train) > 50 and not held & train
    with pytest.raises(RuntimeError, match="distinct held-out problems"):
        get_taskset(_cfg("arithmetic", max_digits=1, ops=["+"], num_heldout=90)).heldout()


@pytest.mark.parametrize("name", NAMES)
def test_demonstrations_verify_and_tokenize(name: str) -> None:
    ts = get_taskset(_cfg(name))
    for task in ts.train_batch(0, 200) + ts.heldout()[:50]:
        demo = ts.demonstration(task)
        assert ts.verify(task, demo) == (1.0, "correct")
        assert ts.verify(task, f"  {demo}\n") == (1.0, "correct")
        ids = ts.prompt_ids(task) + ts.completion_ids(demo)
        assert ids[0] == ts.tokenizer.bos_id and ids[-1] == ts.tokenizer.eos_id
        assert ts.tokenizer.decode(ids) == task.prompt + demo
        assert Task.from_dict(task.to_dict()) == task


def test_arithmetic_verifier() -> None:
    ts = get_taskset(_cfg("arithmetic", ops=["-"]))
    task = next(t for t in ts.train_batch(0, 100) if t.meta["answer"] < 0)
    answer = task.meta["answer"]
    assert ts.verify(task, str(answer)).reward == 1.0
    reward, reason = ts.verify(task, str(answer + 1))
    assert reward == 0.0 and reason.startswith("wrong answer")
    assert ts.verify(task, str(-answer)).reward == 0.0
    assert ts.verify(task, f"{answer} {answer}") == (0.0, f"not an integer: '{answer} {answer}'")
    assert task.prompt == f"{task.meta['a']}-{task.meta['b']}="


def _carryless_by_hand(a: int, op: str, b: int) -> int:
    """Digit strings, column by column, no carry or borrow: an independent reference."""
    if op == "-" and a < b:
        return -_carryless_by_hand(b, op, a)
    da, db = str(a)[::-1], str(b)[::-1].ljust(len(str(a)), "0")
    da = da.ljust(len(db), "0")
    pairs = zip(da, db, strict=True)
    cols = [(int(x) + int(y)) % 10 if op == "+" else (int(x) - int(y)) % 10 for x, y in pairs]
    return int("".join(str(c) for c in reversed(cols)))


def test_carryless_teacher_examples() -> None:
    from slipstream.tasks.arithmetic import _carryless

    assert _carryless(57, "+", 68) == 15  # 7+8 -> 5, 5+6 -> 1
    assert _carryless(52, "-", 38) == 24  # 2-8 -> 4, 5-3 -> 2
    assert _carryless(38, "-", 52) == -24
    assert _carryless(10, "-", 1) == 19
    assert _carryless(99, "+", 1) == 90
    assert _carryless(0, "+", 0) == 0
    for a in range(0, 100, 7):
        for b in range(0, 100, 3):
            for op in "+-":
                assert _carryless(a, op, b) == _carryless_by_hand(a, op, b), (a, op, b)
    assert _carryless(23, "+", 41) == 64 and _carryless(58, "-", 23) == 35  # no carry: exact


def test_imperfect_teacher_drops_carries_at_the_configured_rate() -> None:
    from slipstream.tasks.arithmetic import _carryless

    exact = get_taskset(_cfg("arithmetic", ops=["+", "-", "*"]))
    noisy = get_taskset(_cfg("arithmetic", ops=["+", "-", "*"], demo_drop_carry=0.8))
    tasks = exact.train_batch(0, 3000)
    assert tasks == noisy.train_batch(0, 3000)  # the problems do not change, only their demos
    needs_carry = dropped = 0
    for task in tasks:
        meta = task.meta
        demo, truth = noisy.demonstration(task), str(meta["answer"])
        assert exact.demonstration(task) == truth == noisy.reference(task)  # what task check scores
        assert noisy.demonstration(task) == demo  # deterministic per problem
        if meta["op"] == "*" or _carryless(meta["a"], meta["op"], meta["b"]) == meta["answer"]:
            assert demo == truth  # products and carry-free problems are demonstrated exactly
            continue
        needs_carry += 1
        if demo != truth:
            dropped += 1
            assert demo == str(_carryless(meta["a"], meta["op"], meta["b"]))
            # the verifier is never fooled by the teacher
            assert noisy.verify(task, demo).reward == 0.0
    assert needs_carry > 500
    assert 0.75 < dropped / needs_carry < 0.85
    for held in noisy.heldout()[:50]:
        assert noisy.verify(held, str(held.meta["answer"])) == (1.0, "correct")


def test_countdown_verifier() -> None:
    ts = get_taskset(_cfg("countdown"))
    task = Task("t", "p", "k", {"numbers": [3, 8, 5, 12], "target": 29, "witness": "8*3+5"})
    assert ts.verify(task, "8*3+5") == (1.0, "correct")
    assert ts.verify(task, "(12-8)*5+3*3").reward == 0.0  # 3 used twice
    assert "not given" in ts.verify(task, "(12-8)*5+3*3").reason
    assert ts.verify(task, "29").reward == 0.0  # 29 not given
    assert ts.verify(task, "12+8+5+3").reason == "wrong value: 28 != 29"
    assert ts.verify(task, "(5*12-3)/8*8/3+10").reward == 0.0  # 10 not given
    # Exact rational arithmetic: 12/8 is not truncated.
    half = Task("t", "p", "k", {"numbers": [3, 12, 8, 1], "target": 3, "witness": ""})
    assert ts.verify(half, "12/8*(3-1)") == (1.0, "correct")


def test_solver_finds_shortest_and_reports_unsolvable() -> None:
    assert solve([3, 8, 5, 12], 24) in {"3*8", "8*3"}
    expr = solve([1, 2, 3, 4], 24)
    assert expr is not None and parse_expression(expr).value == 24
    assert solve([1, 1], 97) is None


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("label", list(HOSTILE))
def test_hostile_outputs_score_zero_with_reason(name: str, label: str) -> None:
    ts = get_taskset(_cfg(name))
    task = ts.heldout()[0]
    reward, reason = ts.verify(task, HOSTILE[label])
    assert reward == 0.0
    assert isinstance(reason, str) and reason and reason != "correct"


def test_expr_parser_limits_and_reasons() -> None:
    cases = {
        "9**9**9": "power",
        "1/0": "division by zero",
        "(" * 20 + "1" + ")" * 20: "nested deeper",
        "x" * 300: "too long",
        "2*π": "non-ASCII",
        "1.5": "'.' not allowed",
        "1234567890": "longer than",
        "99999999*99999999": "magnitude",
        "1+": "ends early",
        "(1": "missing ')'",
        "1)": "unexpected ')'",
        "": "empty",
        "-1": "unexpected '-'",
    }
    for text, fragment in cases.items():
        with pytest.raises(ExprError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
            parse_expression(text)
    parsed = parse_expression(" (1 + 2) * 3 - 8 / 4 ")
    assert parsed.value == 7 and parsed.numbers == (1, 2, 3, 8, 4)


def test_unknown_task_name_fails_loudly(monkeypatch) -> None:
    cfg = _cfg("arithmetic")
    object.__setattr__(cfg, "name", "nonexistent")  # bypass validation to reach the registry
    with pytest.raises(ValueError, match="nonexistent"):
        get_taskset(cfg)
