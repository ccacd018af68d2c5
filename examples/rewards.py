"""Reward functions for the example dataset (examples/make_data.py), with TRL's signature:
`f(prompts, completions, **columns) -> list[float | None]`, one value per completion; None means
"not applicable" (never a zero). Every column of the row except the prompt arrives as a keyword
argument holding one value per completion, so one function reads the answer of each layout:
`answer` (TRL), `reward_model` (verl: its `ground_truth`), `label` (OpenRLHF / slime).

    [[reward.functions]]
    name = "correct"
    kind = "python"
    function = "examples.rewards:addition_correct"   # importable: run from the repository root
                                                      # with PYTHONPATH=.

A completion is a string for a string prompt and `[{"role": "assistant", "content": ...}]` for a
chat prompt, as TRL passes them.
"""

from __future__ import annotations

from typing import Any


def _text(completion: Any) -> str:
    if isinstance(completion, list):  # conversational: the assistant message
        return str(completion[-1]["content"]) if completion else ""
    return str(completion)


def _reference(k: int, columns: dict[str, list[Any]]) -> str | None:
    if "answer" in columns:
        return str(columns["answer"][k])
    if "reward_model" in columns:
        return str(columns["reward_model"][k]["ground_truth"])
    if "label" in columns:
        return str(columns["label"][k])
    return None


def addition_correct(
    prompts: list[Any], completions: list[Any], **columns: Any
) -> list[float | None]:
    """1.0 when the completion is the sum (surrounding whitespace ignored), else 0.0."""
    out: list[float | None] = []
    for k, completion in enumerate(completions):
        ref = _reference(k, columns)
        out.append(None if ref is None else float(_text(completion).strip() == ref))
    return out


def digits_only(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float | None]:
    """A format reward: 1.0 for a non-empty answer made of digits (a shaping term to weight
    lightly; it needs no reference, so an empty completion scores 0)."""
    return [float(_text(c).strip().isdigit()) for c in completions]
