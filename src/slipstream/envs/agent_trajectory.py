"""Token-exact trajectories from an agent episode's recorded calls.

An agent calls the endpoint several times; each call is (prompt ids as the engine was fed them,
the ids it sampled). A call whose prompt starts with the previous call's prompt + completion
(the agent appended to its history: the reply as the chat template renders it, tool results,
the next user turn) continues the same training sequence: the new prompt tokens are
observation tokens (mask 0) and the newly sampled ids are trained on (mask 1). A call whose
prompt does not extend it (the agent truncated or summarised its history, or the template
re-rendered the reply to other ids) starts a new sequence: the episode then yields several
samples that share its reward (`segments` > 1, counted as a history rewrite).

Nothing is re-tokenised: every id in a segment is one the engine was fed or sampled, and the
behaviour logprobs, per-token versions and routed experts are the engine's, in order. Routing is
stitched as the episode loop does it (envs/episode.py): each row comes from the call that first
fed that position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from slipstream.engine.base import Completion


@dataclass
class Segment:
    """One training sequence of an agent episode: prompt, then (observation, sampled)* ids."""

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    num_calls: int = 0
    finish_reason: str = "stop"
    routing: list[Any] = field(default_factory=list)
    routing_rows: int = 0

    @property
    def sequence(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def add(self, c: Completion) -> None:
        self.completion_ids.extend(c.token_ids)
        self.loss_mask.extend([1] * len(c.token_ids))
        self.logprobs.extend(c.logprobs)
        self.versions.extend(c.versions)
        self.num_calls += 1
        self.finish_reason = c.finish_reason
        if c.routed_experts is not None:
            self.routing.append(c.routed_experts[self.routing_rows :])
            self.routing_rows = int(c.routed_experts.shape[0])

    def observe(self, ids: Sequence[int]) -> None:
        self.completion_ids.extend(ids)
        self.loss_mask.extend([0] * len(ids))

    def routed_experts(self) -> Any:
        """(P + C - 1, L, k) routing of the whole segment, or None when not recorded."""
        if not self.routing:
            return None
        import torch

        return torch.cat(self.routing) if len(self.routing) > 1 else self.routing[0]


def extends(prompt: Sequence[int], sequence: Sequence[int]) -> bool:
    """Whether `prompt` starts with `sequence` (a continuation of the same trajectory)."""
    n = len(sequence)
    return len(prompt) >= n and list(prompt[:n]) == list(sequence)


def segments(calls: Sequence[tuple[Sequence[int], Completion]]) -> list[Segment]:
    """The calls (prompt ids, completion), in the order they were made, as training
    sequences (see the module docstring). Calls that sampled nothing add no segment."""
    out: list[Segment] = []
    for prompt, c in calls:
        if not c.token_ids:
            continue
        cur = out[-1] if out else None
        if cur is not None and extends(prompt, cur.sequence):
            cur.observe(prompt[len(cur.sequence) :])
        else:
            cur = Segment(list(prompt))
            out.append(cur)
        cur.add(c)
    return out


REWARD_INPUTS_KEY = "agent_episode"
"""The task-meta key under which an agent episode hands reward functions its extra inputs
(`messages`, `agent_output`: envs/agent.py sets it on the copy of the task it scores;
rewards/rewardset.py's `reward_inputs` passes them as keyword arguments, like columns)."""


def final_messages(prompt_messages: list[dict[str, Any]],
                   reply: dict[str, Any]) -> list[dict[str, Any]]:  # fmt: skip
    """The episode's final conversation, OpenAI-style: the last chat call's request messages
    (as rendered) and the assistant message it was answered with."""
    return [dict(m) for m in prompt_messages] + [dict(reply)]
