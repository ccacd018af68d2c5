"""A safe arithmetic-expression parser for verifying model output. Never `eval`.

Grammar (whitelist; anything else is rejected):

    expr   := term (('+' | '-') term)*
    term   := factor (('*' | '/') factor)*
    factor := INT | '(' expr ')'
    INT    := [0-9]+          (no sign, no decimal point, no exponent, no '**')

Every limit is checked before the work it bounds, so hostile input (a megabyte of text, `9**9**9`,
ten thousand open parentheses, division by zero, non-ASCII) is rejected in time linear in the
*limit*, not the input: the length check happens first, the depth limit bounds recursion, and every
intermediate value is an exact Fraction whose numerator and denominator are bounded by
`max_abs_value`, so nothing can grow without limit.

`parse_expression` raises `ExprError(reason)` on any rejection; callers turn that into reward 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

ALLOWED = frozenset("0123456789+-*/() ")


class ExprError(ValueError):
    """The expression was rejected; `str(err)` is a short human-readable reason."""


@dataclass(frozen=True)
class ExprLimits:
    max_chars: int = 256
    """Longest accepted expression text (checked before anything else)."""
    max_depth: int = 16
    """Deepest parenthesis nesting."""
    max_literal_digits: int = 9
    """Longest integer literal."""
    max_abs_value: int = 10**12
    """Bound on |numerator| and denominator of every intermediate value."""
    max_literals: int = 32
    """Most integer literals in one expression."""


@dataclass(frozen=True)
class ParsedExpr:
    value: Fraction
    numbers: tuple[int, ...]
    """The integer literals in order of appearance (for 'each number at most once' checks)."""


def tokenize(text: str, limits: ExprLimits) -> list[str]:
    if len(text) > limits.max_chars:
        raise ExprError(f"expression too long ({len(text)} > {limits.max_chars} characters)")
    if not text.isascii():
        raise ExprError("non-ASCII character in expression")
    bad = next((c for c in text if c not in ALLOWED), None)
    if bad is not None:
        raise ExprError(f"character {bad!r} not allowed in expression")
    tokens: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c == " ":
            i += 1
        elif c.isdigit():
            j = i
            while j < len(text) and text[j].isdigit():
                j += 1
            if j - i > limits.max_literal_digits:
                raise ExprError(f"number literal longer than {limits.max_literal_digits} digits")
            tokens.append(text[i:j])
            i = j
        else:
            if c == "*" and i + 1 < len(text) and text[i + 1] == "*":
                raise ExprError("'**' (power) is not allowed")
            tokens.append(c)
            i += 1
    if not tokens:
        raise ExprError("empty expression")
    if sum(t.isdigit() for t in tokens) > limits.max_literals:
        raise ExprError(f"more than {limits.max_literals} numbers in expression")
    return tokens


class _Parser:
    def __init__(self, tokens: list[str], limits: ExprLimits) -> None:
        self.tokens = tokens
        self.pos = 0
        self.limits = limits
        self.numbers: list[int] = []

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        tok = self.tokens[self.pos]
        self.pos += 1
        return tok

    def check(self, value: Fraction) -> Fraction:
        bound = self.limits.max_abs_value
        if abs(value.numerator) > bound or value.denominator > bound:
            raise ExprError(f"intermediate value exceeds magnitude limit {bound}")
        return value

    def expr(self, depth: int) -> Fraction:
        value = self.term(depth)
        while self.peek() in ("+", "-"):
            op = self.take()
            rhs = self.term(depth)
            value = self.check(value + rhs if op == "+" else value - rhs)
        return value

    def term(self, depth: int) -> Fraction:
        value = self.factor(depth)
        while self.peek() in ("*", "/"):
            op = self.take()
            rhs = self.factor(depth)
            if op == "*":
                value = self.check(value * rhs)
            elif rhs == 0:
                raise ExprError("division by zero")
            else:
                value = self.check(value / rhs)
        return value

    def factor(self, depth: int) -> Fraction:
        tok = self.peek()
        if tok is None:
            raise ExprError("expression ends early")
        if tok == "(":
            if depth >= self.limits.max_depth:
                raise ExprError(f"parentheses nested deeper than {self.limits.max_depth}")
            self.take()
            value = self.expr(depth + 1)
            if self.peek() != ")":
                raise ExprError("missing ')'")
            self.take()
            return value
        if tok.isdigit():
            self.take()
            self.numbers.append(int(tok))
            return self.check(Fraction(int(tok)))
        raise ExprError(f"unexpected {tok!r}")


def parse_expression(text: str, limits: ExprLimits | None = None) -> ParsedExpr:
    """Parse and evaluate `text` exactly; raise ExprError with a reason on any rejection."""
    limits = limits or ExprLimits()
    tokens = tokenize(text, limits)
    parser = _Parser(tokens, limits)
    value = parser.expr(0)
    if parser.pos != len(tokens):
        raise ExprError(f"unexpected {tokens[parser.pos]!r} after expression")
    return ParsedExpr(value=value, numbers=tuple(parser.numbers))
