"""Countdown: given numbers and a target, write an expression that reaches the target using each
given number at most once, with + - * / and parentheses.

Prompt `"3 8 5 12 -> 29: "`, completion e.g. `"8*3+5"`. Every generated instance is solvable: the
generator builds a random expression over a random subset of the numbers and takes its (positive,
integer) value as the target. The demonstration is the solver's answer: an exhaustive search that
prefers solutions using fewer numbers (deterministic), with the generator's witness as a fallback
if the search budget runs out.

The verifier parses with `slipstream.tasks.expr` (whitelist, limits on length, depth, literal size
and magnitude; exact rational arithmetic), then checks the multiset of literals against the given
numbers and the value against the target. Reward is binary; the reason says what failed.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from fractions import Fraction
from itertools import combinations
from typing import TYPE_CHECKING, Any

from slipstream.tasks.base import GeneratedTaskSet, Task, Verdict
from slipstream.tasks.expr import ExprError, ExprLimits, parse_expression

if TYPE_CHECKING:
    from slipstream.config.task import TaskConfig
    from slipstream.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)
_warned_fallback = False

LIMITS = ExprLimits(max_chars=128, max_depth=8, max_literal_digits=6, max_abs_value=10**9)
# Nodes the solver may visit per instance (5 numbers need up to ~1e5 in the worst case).
SOLVER_BUDGET = 200_000
# Random expressions tried per generated instance before the config is declared unusable.
MAX_TRIES = 1000

# An expression with its value and precedence (3 atom, 2 * /, 1 + -) for minimal parentheses.
Item = tuple[Fraction, str, int]


def _wrap(item: Item, min_prec: int) -> str:
    return item[1] if item[2] >= min_prec else f"({item[1]})"


def _combine(x: Item, y: Item) -> list[Item]:
    """Every exact binary combination of x and y (both orders for - and /)."""
    out: list[Item] = [
        (x[0] + y[0], f"{_wrap(x, 1)}+{_wrap(y, 1)}", 1),
        (x[0] * y[0], f"{_wrap(x, 2)}*{_wrap(y, 2)}", 2),
        (x[0] - y[0], f"{_wrap(x, 1)}-{_wrap(y, 2)}", 1),
        (y[0] - x[0], f"{_wrap(y, 1)}-{_wrap(x, 2)}", 1),
    ]
    if y[0] != 0:
        out.append((x[0] / y[0], f"{_wrap(x, 2)}/{_wrap(y, 3)}", 2))
    if x[0] != 0:
        out.append((y[0] / x[0], f"{_wrap(y, 2)}/{_wrap(x, 3)}", 2))
    return out


def solve(numbers: list[int], target: int, budget: int = SOLVER_BUDGET) -> str | None:
    """An expression over a sub-multiset of `numbers` equal to `target`, or None (no solution, or
    the budget ran out). Searches subsets of growing size, so short answers come first."""
    goal = Fraction(target)
    visited = 0

    def search(items: list[Item]) -> str | None:
        nonlocal visited
        visited += 1
        if visited > budget:
            return None
        if len(items) == 1:
            return items[0][1] if items[0][0] == goal else None
        for i in range(len(items)):
            for j in range(i + 1, len(items)):
                rest = [it for k, it in enumerate(items) if k not in (i, j)]
                for combined in _combine(items[i], items[j]):
                    found = search([*rest, combined])
                    if found is not None:
                        return found
        return None

    atoms: list[Item] = [(Fraction(n), str(n), 3) for n in numbers]
    for size in range(1, len(numbers) + 1):
        for subset in combinations(atoms, size):
            found = search(list(subset))
            if found is not None:
                return found
            if visited > budget:
                return None
    return None


def _random_expression(rng: random.Random, numbers: list[int]) -> Item:
    """A random expression tree over all of `numbers` (each once)."""
    items: list[Item] = [(Fraction(n), str(n), 3) for n in numbers]
    while len(items) > 1:
        i, j = rng.sample(range(len(items)), 2)
        x, y = items[i], items[j]
        items = [it for k, it in enumerate(items) if k not in (i, j)]
        items.append(rng.choice(_combine(x, y)))
    return items[0]


class CountdownTaskSet(GeneratedTaskSet):
    name = "countdown"

    def generate(self, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
        n = self.cfg.countdown_numbers
        for _ in range(MAX_TRIES):
            numbers = [rng.randint(1, self.cfg.countdown_max_number) for _ in range(n)]
            used = rng.sample(numbers, rng.randint(2, n))
            value, witness, _ = _random_expression(rng, used)
            if value.denominator != 1 or not 1 <= value <= self.cfg.countdown_max_target:
                continue
            target = int(value)
            if target in numbers:  # trivial instance
                continue
            key = f"{sorted(numbers)}->{target}"
            prompt = f"{' '.join(map(str, numbers))} -> {target}: "
            return key, prompt, {"numbers": numbers, "target": target, "witness": witness}
        raise RuntimeError(
            f"countdown: no instance with a target in 1..{self.cfg.countdown_max_target} in "
            f"{MAX_TRIES} tries; raise task.countdown_max_target or task.countdown_max_number"
        )

    def demonstration(self, task: Task) -> str:
        found = solve(task.meta["numbers"], task.meta["target"])
        if found is not None:
            return found
        global _warned_fallback
        if not _warned_fallback:
            log.warning(
                "countdown: solver budget (%d nodes) ran out on %s; using the generator's witness "
                "expression as the demonstration (logged once)",
                SOLVER_BUDGET,
                task.task_id,
            )
            _warned_fallback = True
        return task.meta["witness"]

    def verify(self, task: Task, completion: str) -> Verdict:
        text = completion.strip()
        try:
            parsed = parse_expression(text, LIMITS)
        except ExprError as e:
            return Verdict(0.0, str(e))
        extra = Counter(parsed.numbers) - Counter(task.meta["numbers"])
        if extra:
            return Verdict(
                0.0, f"uses numbers not given (or too often): {sorted(extra.elements())}"
            )
        if parsed.value != task.meta["target"]:
            return Verdict(0.0, f"wrong value: {parsed.value} != {task.meta['target']}")
        return Verdict(1.0, "correct")


def make_taskset(cfg: TaskConfig, tokenizer: Tokenizer) -> CountdownTaskSet:
    return CountdownTaskSet(cfg, tokenizer)
