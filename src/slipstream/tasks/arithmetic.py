"""Multi-digit integer arithmetic: prompt `"123*45="`, completion `"5535"`.

Operands have between task.min_digits and task.max_digits digits (digit count uniform, then the
value uniform among numbers with that many digits); the operator is uniform over task.ops. Results
of `-` may be negative. The verifier accepts exactly one optionally-signed integer, surrounded by
optional whitespace; anything else scores 0 with a reason.

Demonstrations are exact unless `task.demo_drop_carry` > 0: then that share of the `+`/`-` problems
whose carry-less answer differs from the true one (a carry or borrow is needed) is demonstrated with
the carry-less answer, the classic error of a weak arithmetic teacher. Which problems is a keyed
hash of (seed, problem), so the demonstration set is deterministic. The verifier never changes.
"""

from __future__ import annotations

import random
import re
from typing import TYPE_CHECKING, Any

from slipstream.tasks.base import GeneratedTaskSet, Task, Verdict, keyed_uniform

if TYPE_CHECKING:
    from slipstream.config.task import TaskConfig
    from slipstream.model.tokenizer import Tokenizer

# Longest completion the verifier even looks at: an 18-digit x 18-digit product has 36 digits.
MAX_ANSWER_CHARS = 64
_INT_RE = re.compile(r"-?[0-9]{1,40}")


def _operand(rng: random.Random, min_digits: int, max_digits: int) -> int:
    digits = rng.randint(min_digits, max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def _carryless(a: int, op: str, b: int) -> int:
    """`a op b` computed digit by digit with every carry (`+`) or borrow (`-`) dropped:
    57+68 -> 15, 52-38 -> 24, 38-52 -> -(52-38 carry-less) = -24. Operands are >= 0."""
    if op == "-" and a < b:
        return -_carryless(b, op, a)
    out, place = 0, 1
    while a or b:
        da, db = a % 10, b % 10
        out += ((da + db) % 10 if op == "+" else (da - db) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return out


def _apply(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"arithmetic: unknown operator {op!r}")


class ArithmeticTaskSet(GeneratedTaskSet):
    name = "arithmetic"

    def generate(self, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
        a = _operand(rng, self.cfg.min_digits, self.cfg.max_digits)
        b = _operand(rng, self.cfg.min_digits, self.cfg.max_digits)
        op = rng.choice(self.cfg.ops)
        prompt = f"{a}{op}{b}="
        return prompt, prompt, {"a": a, "b": b, "op": op, "answer": _apply(a, op, b)}

    def reference(self, task: Task) -> str:
        return str(task.meta["answer"])

    def demonstration(self, task: Task) -> str:
        """The answer, or (task.demo_drop_carry) the carry-less answer for a keyed share of the
        `+`/`-` problems that need a carry or borrow."""
        meta = task.meta
        rate = self.cfg.demo_drop_carry
        if rate > 0 and meta["op"] in ("+", "-"):
            wrong = _carryless(meta["a"], meta["op"], meta["b"])
            if wrong != meta["answer"] and keyed_uniform(self.cfg.seed, "teacher", task.key) < rate:
                return str(wrong)
        return self.reference(task)

    def verify(self, task: Task, completion: str) -> Verdict:
        if len(completion) > MAX_ANSWER_CHARS:
            return Verdict(
                0.0, f"completion too long ({len(completion)} > {MAX_ANSWER_CHARS} chars)"
            )
        text = completion.strip()
        if not text:
            return Verdict(0.0, "empty completion")
        if not text.isascii():
            return Verdict(0.0, "non-ASCII character in completion")
        if _INT_RE.fullmatch(text) is None:
            return Verdict(0.0, f"not an integer: {text[:20]!r}")
        got = int(text)
        expected = int(task.meta["answer"])
        if got == expected:
            return Verdict(1.0, "correct")
        return Verdict(0.0, f"wrong answer: got {got}, expected {expected}")


def make_taskset(cfg: TaskConfig, tokenizer: Tokenizer) -> ArithmeticTaskSet:
    return ArithmeticTaskSet(cfg, tokenizer)
