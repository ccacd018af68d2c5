"""The environment protocol: what an episode is, token in and token out.

    env = factory()                          # one Environment per episode (EnvFactory)
    prompt_ids = env.reset(task)             # the first observation: what the policy is fed
    result = env.step(action_ids, last=False)   # the policy's sampled ids of one turn
    result.observation_ids, result.reward, result.done
    env.close()                              # always, however the episode ended

Token-in/token-out: `step` receives the ids the engine sampled, exactly (the episode keeps them
as they are; an environment may decode them to *read* the action, never to rebuild the
sequence), and returns its observation as ids, tokenized once, which the episode appends as
they are. The sequence the trainer sees is therefore prompt ids + (sampled ids, observation
ids)*, byte for byte what the engine was fed and what it produced.

`last=True` tells the environment that no further turn will follow (the episode's turn, token or
time budget is spent): it must return `done=True` with the episode's reward. An observation
returned with `done=False` may hold at most `max_observation_tokens` ids (EpisodeLimits); the
runner checks it.

Infrastructure is not a reward: an environment raises `InfraError` when something outside the
policy's control failed (no sandbox within the acquire timeout, the pool stopped, the sandbox
died under the episode, a verifier gave no verdict). The episode runner then re-runs the episode
from its start (bounded by `max_infra_retries`) or gives up on the task; it never turns the
failure into a reward. Whatever the *policy's output* does (a tool program that loops, crashes,
floods output) is an observation or a reward, never an InfraError.

Not covered here: the episode loop (episode.py), sandboxes (sandboxes.py), the environments.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from slipstream.tasks import Task

if TYPE_CHECKING:
    from slipstream.config.rl import RolloutConfig


class InfraError(RuntimeError):
    """An infrastructure failure during an episode: not a reward (see the module docstring)."""


class RewardDropped(InfraError):
    """A reward function gave no usable reward for this episode or group after its bounded
    retries (it raised, timed out, crashed its process, returned the wrong length, a non-number
    or a non-finite value; slipstream/rewards). Re-running the episode does not help: the group is
    dropped at once (status `dropped`, counted), never rewarded. `fatal` (non-empty): the
    function failed on `reward.max_consecutive_failures` calls in a row; the job stops with
    this one-line message."""

    def __init__(self, message: str, fatal: str = "") -> None:
        super().__init__(message)
        self.fatal = fatal


class ServiceUnavailable(InfraError):
    """A shared service the reward needs (a reward-model server) did not answer. Not the task's
    fault, and re-running the episode at once would hit the same outage: the group is given up
    without a reward and its task requeued (`aborted`, the worker nacks it), not dropped."""


@dataclass
class StepResult:
    observation_ids: list[int]
    """Tokens to append after the action (empty when done)."""
    reward: float
    """Reward of this step; the episode's reward is the sum over its steps (in [0, 1] for the
    built-in environments, which reward only the final step)."""
    done: bool
    reason: str = ""
    """Short explanation of the reward or of why the episode goes on."""
    components: dict[str, float | None] = field(default_factory=dict)
    """The reward's components by name (`[[reward.functions]]`; None = not applicable)."""


@dataclass
class EnvUsage:
    """What one episode used, for the run's statistics."""

    tool_calls: int = 0
    tool_s: float = 0.0
    """Wall time of the tool runs (inside the sandbox, round trips included)."""
    sandbox_acquire_s: float = -1.0
    """How long acquiring the episode's sandbox waited; -1 when none was acquired."""


@dataclass
class Demonstration:
    """A teacher's episode for SFT: the first observation, then the completion with its loss
    mask (1: the teacher's tokens, trained on; 0: observation tokens, as the environment would
    have appended them)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    loss_mask: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.loss_mask:
            self.loss_mask = [1] * len(self.completion_ids)
        if len(self.loss_mask) != len(self.completion_ids):
            raise ValueError(
                f"demonstration has {len(self.completion_ids)} completion tokens but a mask of "
                f"{len(self.loss_mask)}"
            )


class Environment(Protocol):
    """One episode's environment (see the module docstring). Used from one thread at a time."""

    stop: tuple[str, ...]
    """Stop strings that end a model turn besides EOS (e.g. "</py>"); the engine keeps the
    token that completed one."""
    usage: EnvUsage

    def reset(self, task: Task) -> list[int]:
        """Start the episode on `task`; -> the first observation's ids (the prompt). May acquire
        resources (a sandbox); InfraError when it cannot."""
        ...

    def step(self, action_ids: Sequence[int], *, last: bool) -> StepResult:
        """The policy's sampled ids of one turn -> observation, reward, done. InfraError on an
        infrastructure failure; anything the action does is a result."""
        ...

    def demonstration(self, task: Task) -> Demonstration:
        """A teacher's episode for SFT, without running anything (no reset needed)."""
        ...

    def close(self) -> None:
        """Release what the episode holds (its sandbox). Idempotent; never raises."""
        ...


EnvFactory = Callable[[], Environment]


class Score(tuple):
    """A scorer's answer: (reward, reason) — it is that pair, equal to it and unpacked as it —
    plus the reward's `components` by name (the `[[reward.functions]]` scores; None = not
    applicable)."""

    components: dict[str, float | None]

    def __new__(cls, reward: float, reason: str,
                components: dict[str, float | None] | None = None) -> Score:  # fmt: skip
        self = super().__new__(cls, (reward, reason))
        self.components = dict(components or {})
        return self

    @property
    def reward(self) -> float:
        return self[0]

    @property
    def reason(self) -> str:
        return self[1]


def score_components(score: tuple[float, str]) -> dict[str, float | None]:
    """The components of a scorer's answer ({} for a plain (reward, reason) tuple)."""
    return score.components if isinstance(score, Score) else {}


Scorer = Callable[[Task, str], tuple[float, str]]
"""(task, answer text) -> (reward, reason); raises InfraError on infrastructure failure (the
worker's Verifier.verify)."""


@dataclass(frozen=True)
class EpisodeLimits:
    """Bounds of every episode (the runner enforces them; `rollout.*` in the config)."""

    max_turns: int = 8
    """Most model turns (engine requests) per episode; single-turn environments end after one."""
    max_turn_tokens: int = 32
    """Most tokens sampled in one turn."""
    max_episode_tokens: int = 0
    """Most completion tokens of the episode, sampled and observation tokens together; 0 = what
    the engine's context leaves after the prompt."""
    max_observation_tokens: int = 64
    """Most tokens of one observation (tool output is capped to fit)."""
    turn_timeout_s: float = 30.0
    """Most seconds one tool run may take (its process group is killed; the observation says
    so). Generation itself is not bounded by it."""
    episode_timeout_s: float = 300.0
    """Wall-clock bound of an episode, checked at each turn boundary: past it the next step is
    the last one."""
    max_infra_retries: int = 2
    """Re-runs of an episode after infrastructure failures before its task is given up."""

    @classmethod
    def from_config(cls, cfg: RolloutConfig, max_turn_tokens: int) -> EpisodeLimits:
        """The `[rollout]` bounds, with the turn's token cap given (rollout.max_new_tokens or the
        engine's default; eval.max_new_tokens for evaluation)."""
        return cls(
            max_turns=cfg.max_turns, max_turn_tokens=max_turn_tokens,
            max_episode_tokens=cfg.max_episode_tokens,
            max_observation_tokens=cfg.max_observation_tokens,
            turn_timeout_s=cfg.turn_timeout_s, episode_timeout_s=cfg.episode_timeout_s,
            max_infra_retries=cfg.max_infra_retries,
        )  # fmt: skip

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_turn_tokens", "max_observation_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"episode limit {name} must be >= 1, got {getattr(self, name)}")
        if self.max_episode_tokens < 0 or self.max_infra_retries < 0:
            raise ValueError("episode limits max_episode_tokens and max_infra_retries must be >= 0")
        if not (self.turn_timeout_s > 0 and self.episode_timeout_s > 0):
            raise ValueError("episode timeouts must be > 0")


def encode_observation(tokenizer: Any, text: str, max_tokens: int) -> list[int]:
    """Tokenize an observation once, at most `max_tokens` ids. Text the tokenizer cannot express
    (a character outside the char vocabulary) becomes "?" character by character, and special
    ids (BOS, EOS, pad) that tool output spelled out are dropped: an observation can never end
    the episode or fake a turn boundary."""
    try:
        ids = tokenizer.encode(text)
    except ValueError:
        ids = []
        fallback = tokenizer.encode("?")
        for ch in text:
            try:
                ids.extend(tokenizer.encode(ch))
            except ValueError:
                ids.extend(fallback)
    specials = {tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id}
    return [i for i in ids if i not in specials][:max_tokens]
