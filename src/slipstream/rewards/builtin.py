"""The built-in reward kinds, as functions with TRL's reward signature `f(prompts, completions,
**columns) -> list[float | None]`; they run in the reward processes like users' functions.

- `math`: Hugging Face math-verify, gold first: `verify(parse(reference), parse(completion))`
  with the library's default extraction (LaTeX, `\\boxed{}`, plain expressions), 1.0 or 0.0;
  None when there is no reference or it does not parse (not applicable, TRL's rule). Its
  parse/verify timeouts use `signal.alarm`, which works here: the call runs on the reward
  process's main thread; the pool's wall-clock kill is the backstop for what the alarm misses.
- `exact`: `normalise(completion) == normalise(reference)`.
- `regex`: the pattern's last match in the completion, its first group normalised, equals the
  normalised reference; no match scores 0.

`normalise`: Unicode NFKC, surrounding whitespace and `$`, trailing `.` removed, inner
whitespace collapsed, lower case. A completion given as chat messages (TRL's conversational
format) is its last message's content.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from typing import Any

Reward = list[float | None]


def completion_text(c: Any) -> str:
    """A completion's text: the string itself, or the content of its last message."""
    if isinstance(c, str):
        return c
    if isinstance(c, list) and c and isinstance(c[-1], dict):
        return str(c[-1].get("content", ""))
    return str(c)


def normalise(text: str) -> str:
    t = unicodedata.normalize("NFKC", text).strip().strip("$").strip()
    t = re.sub(r"\s+", " ", t).rstrip(".").strip()
    return t.lower()


def _references(kwargs: dict[str, Any], n: int) -> list[Any]:
    """The reference answers the caller (RewardSet) passes as `reference`: the task's answer or
    the function's `answer_key` column."""
    refs = list(kwargs["reference"])
    if len(refs) != n:
        raise ValueError(f"{len(refs)} reference answers for {n} completions")
    return refs


def make(spec: Any) -> Callable[..., Reward]:
    """The function of a built-in kind (a FunctionSpec)."""
    if spec.kind == "math":
        return _math_reward(max(1, int(spec.timeout_s * 0.4)))
    if spec.kind == "exact":

        def exact(prompts: list[Any], completions: list[Any], **kw: Any) -> Reward:
            refs = _references(kw, len(completions))
            return [None if r is None else float(normalise(completion_text(c)) == normalise(str(r)))
                    for c, r in zip(completions, refs, strict=True)]  # fmt: skip

        return exact
    if spec.kind == "regex":
        pattern = re.compile(spec.pattern)

        def regex(prompts: list[Any], completions: list[Any], **kw: Any) -> Reward:
            refs = _references(kw, len(completions))
            out: Reward = []
            for c, r in zip(completions, refs, strict=True):
                if r is None:
                    out.append(None)
                    continue
                matches = list(pattern.finditer(completion_text(c)))
                got = matches[-1].group(1) if matches else None
                out.append(float(got is not None and normalise(got) == normalise(str(r))))
            return out

        return regex
    raise ValueError(f"unknown reward kind {spec.kind!r}")


def _math_reward(timeout_s: int) -> Callable[..., Reward]:
    from math_verify import parse, verify

    def math_reward(prompts: list[Any], completions: list[Any], **kw: Any) -> Reward:
        refs = _references(kw, len(completions))
        out: Reward = []
        for c, r in zip(completions, refs, strict=True):
            if r is None:
                out.append(None)
                continue
            gold = parse(str(r), parsing_timeout=timeout_s)
            if not gold:
                out.append(None)
                continue
            pred = parse(completion_text(c), parsing_timeout=timeout_s)
            out.append(float(verify(gold, pred, timeout_seconds=timeout_s)))
        return out

    return math_reward
