"""`kind = "math"`: scored in the reward processes exactly as math-verify scores the pair when
called directly (gold first: `verify(parse(gold), parse(prediction))`), on LaTeX fractions,
`\\boxed{}`, units, equivalent expressions and wrong answers; a pathological answer returns within
its timeout and the process survives."""

from __future__ import annotations

import time

import pytest
from math_verify import parse, verify

from slipstream.config.rm import RewardConfig
from slipstream.envs.base import RewardDropped
from slipstream.rewards.rewardset import RewardSet
from slipstream.tasks import Task

PAIRS = [  # (gold, prediction)
    ("3/4", "The answer is $\\frac{3}{4}$."),
    ("\\frac{3}{4}", "\\boxed{0.75}"),
    ("\\frac{1}{2}", "\\boxed{\\frac{2}{4}}"),
    ("\\frac{1}{3}", "\\boxed{0.33}"),
    ("2", "\\boxed{2}"),
    ("2", "\\boxed{3}"),
    ("$\\boxed{5}$", "so we get \\boxed{5}"),
    ("10", "The final answer is 10"),
    ("10", "I think it is 11"),
    ("\\sqrt{2}", "\\boxed{\\sqrt{2}}"),
    ("\\sqrt{8}", "\\boxed{2\\sqrt{2}}"),
    ("\\sqrt{2}", "\\boxed{1.414}"),
    ("x^2 + 2x + 1", "\\boxed{(x+1)^2}"),
    ("x^2 - 1", "\\boxed{(x-1)(x+1)}"),
    ("x^2 - 1", "\\boxed{(x-1)^2}"),
    ("\\pi", "\\boxed{\\pi}"),
    ("2\\pi", "\\boxed{6.283185}"),
    ("50\\%", "\\boxed{50\\%}"),
    ("50\\%", "\\boxed{0.5}"),
    ("12 \\text{ cm}", "\\boxed{12}"),
    ("12", "\\boxed{12 \\text{ cm}}"),
    ("5 \\text{ meters}", "\\boxed{5\\,\\text{m}}"),
    ("(1, 2)", "\\boxed{(1,2)}"),
    ("(1, 2)", "\\boxed{(2,1)}"),
    ("\\{1, 2\\}", "\\boxed{\\{2, 1\\}}"),
    ("[0, 1]", "\\boxed{[0,1]}"),
    ("x = 3", "\\boxed{3}"),
    ("3", "\\boxed{x = 3}"),
    ("-\\frac{1}{2}", "\\boxed{-0.5}"),
    ("-\\frac{1}{2}", "\\boxed{\\frac{1}{2}}"),
    ("1000", "\\boxed{1,000}"),
    ("1000", "\\boxed{1 000}"),
    ("e^{i\\pi}", "\\boxed{-1}"),
    ("\\dfrac{7}{8}", "\\boxed{\\tfrac{7}{8}}"),
    ("\\infty", "\\boxed{\\infty}"),
    ("0", "no answer here"),
    ("42", ""),
]


@pytest.fixture(scope="module")
def math_set():  # type: ignore[no-untyped-def]
    rc = RewardConfig.model_validate({"workers": 1, "retries": 0, "functions": [
        {"name": "math", "kind": "math", "timeout_s": 5.0}]})  # fmt: skip
    rs = RewardSet(rc)
    yield rs
    rs.close()


def task_with(gold: str) -> Task:
    return Task("dataset/train/0", "q", "q", {"prompt": "q", "answer": gold,
                                              "columns": {"solution": gold}})  # fmt: skip


def direct(gold: str, pred: str) -> float | None:
    """math-verify called directly, here on the main thread."""
    g = parse(gold)
    if not g:
        return None
    return float(verify(g, parse(pred)))


def test_scores_equal_math_verify_itself(math_set) -> None:  # type: ignore[no-untyped-def]
    assert len(PAIRS) >= 30
    got = [math_set.verify(task_with(g), p).components["math"] for g, p in PAIRS]
    want = [direct(g, p) for g, p in PAIRS]
    assert got == want
    assert 8 <= sum(v == 1.0 for v in got) <= len(PAIRS) - 8  # both right and wrong answers


def test_no_reference_is_not_applicable(math_set) -> None:  # type: ignore[no-untyped-def]
    t = Task("dataset/train/1", "q", "q", {"prompt": "q", "answer": None, "columns": {}})
    s = math_set.verify(t, "\\boxed{1}")
    assert s.components == {"math": None} and s.reward == 0.0  # None adds nothing


def test_pathological_answer_returns_within_its_timeout_and_the_process_survives() -> None:
    rc = RewardConfig.model_validate({"workers": 1, "retries": 0, "functions": [
        {"name": "math", "kind": "math", "timeout_s": 3.0}]})  # fmt: skip
    rs = RewardSet(rc)
    try:
        # sympy evaluates the power tower without end (math-verify's own alarm may not fire
        # inside C code; the pool's wall-clock kill is the backstop)
        t0 = time.monotonic()
        try:
            s = rs.verify(task_with("1"), "\\boxed{9^{9^{9^{9^{9}}}}}")
            assert s.components["math"] in (0.0, None)  # math-verify's timeout: not equal
        except RewardDropped as e:
            assert "reward function 'math'" in str(e)
        assert time.monotonic() - t0 < 3.0 + 2.0
        assert rs.verify(task_with("\\frac{1}{2}"), "\\boxed{0.5}").components == {"math": 1.0}
    finally:
        rs.close()
