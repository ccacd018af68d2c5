"""Plain data passed between the queue, rollout workers, the buffer and the trainer.

Everything here is picklable (lists of ints/floats, no tensors) so it crosses the local transport
(`multiprocessing.managers`) and can be written into a checkpoint as-is.

Vocabulary: a *task* is one prompt of the task set's train split; a *sample* is one completion of
it; a *group* is the G samples of one task (GRPO). Policy versions count optimizer steps: weights
after step k are version k (version 0 = the starting checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


class RolloutFailed(RuntimeError):
    """The rollout side cannot produce data: the launcher gave up (Coordinator.fail), e.g.
    because a worker slot crash-loops. The message says why and ends with the worker's output."""


class TrainerRankLost(RuntimeError):
    """A trainer rank other than rank 0 died, so rank 0's collective with it failed. The message
    names the rank, its exit code and its log (launch/dp.py)."""


class FollowerRanks(Protocol):
    """Trainer ranks 1..W-1 as rank 0 (this process) sees them, however they were placed: the
    controller broadcasts to them (rl/controller.py); the launchers place them (launch/base.py's
    `start_trainer_ranks`: launch/dp.py, launch/ray_ranks.py, launch/scheduled.py). Defined here,
    below both, so the two share one definition."""

    def send(self, command: tuple[Any, ...]) -> None:
        """Broadcast a command (launch/dp.py); rank 0 then does its own part of it."""
        ...

    def lost(self) -> Exception | None:
        """An error naming the ranks that ended, or None while all run."""
        ...

    def close(self, timeout_s: float = 30.0) -> list[int | None]:
        """Wait for them to leave (after ("stop",)), force the rest; exit codes."""
        ...


@dataclass(frozen=True)
class TaskRef:
    """A unit of work in the queue. `task_id` is unique for the whole run (it is the queue's
    sequence number); `index` selects the prompt in the train split (task_id modulo its size), so
    the same prompt may come back in a later epoch under a new task_id."""

    task_id: int
    index: int


@dataclass
class Lease:
    """Tasks handed to one worker until `deadline_s` (monotonic clock of the queue's process).

    `lease_id` is the fencing token: it is unique and never reused, so an ack carrying an old
    lease_id is recognisably stale. `policy_version` is the trainer's version when the lease was
    granted; a worker must generate with weights at least that new (this is what makes `sync`
    mode on-policy)."""

    lease_id: int
    worker_id: str
    tasks: list[TaskRef]
    deadline_s: float
    policy_version: int


@dataclass
class Sample:
    """One episode (a single-turn task: one completion). `prompt_ids` is the environment's first
    observation; `completion_ids` everything after it: the tokens the policy sampled, turn by turn,
    with the observations the environment appended between turns (tool output).

    `loss_mask` has one entry per completion token: 1 sampled by the policy, 0 an observation
    token (never trained on: no policy loss, KL, entropy, value loss, and not counted by the
    token mean). Empty means every completion token was sampled (single-turn samples and
    checkpoints written before multi-turn episodes existed).

    `behaviour_logprobs` and `versions` exist for *sampled* tokens only, in order (so their
    length is the number of 1s in the mask): the engine's log-probability of each sampled token
    (the behaviour policy for off-policy correction) and the policy version that sampled it
    (partial rollouts and later turns may span weight updates). Staleness is therefore counted
    over sampled tokens only."""

    prompt_ids: list[int]
    completion_ids: list[int]
    behaviour_logprobs: list[float]
    versions: list[int]
    reward: float = 0.0
    finish_reason: str = "stop"
    text: str = ""
    loss_mask: list[int] = field(default_factory=list)
    """Per completion token: 1 sampled, 0 observation; empty = all sampled (see above)."""
    num_turns: int = 1
    """Model turns in the episode (engine requests that sampled its tokens)."""
    tool_calls: int = 0
    """Tool calls the environment ran for this episode (e.g. `<py>` programs in its sandbox)."""
    env_s: float = 0.0
    """Wall time inside the environment (reset + steps: sandbox acquire, tool runs, verifier)."""
    tool_s: float = 0.0
    """Of that, the wall time of the tool runs in the episode's sandbox (round trips included)."""
    sandbox_acquire_s: float = -1.0
    """How long acquiring this episode's sandbox waited; -1 when it used no sandbox."""
    infra_retries: int = 0
    """Earlier attempts of this episode that ended in an infrastructure failure and were re-run
    from the start (their tokens are not here; they were never trained on)."""
    routed_experts: bytes = b""
    """The experts the engine routed every input position to (rl/routing.py): for the
    P + C - 1 positions the trainer's forward sees (prompt, then each sampled token but the
    last), per MoE layer, the top-k expert ids, as C-order uint8 (E <= 256) or int16 bytes; row
    j was routed by the weights of version versions[max(0, j - P + 1)]. Empty: not recorded."""
    routing_shape: tuple[int, int] = (0, 0)
    """(MoE layers, k) of `routed_experts`; (0, 0) when not recorded."""
    reward_components: dict[str, float | None] = field(default_factory=dict)
    """The reward's components by name (`[[reward.functions]]`; None = not applicable); `reward`
    is their weighted sum. Empty when the reward is the task's verifier alone."""
    episode: int = -1
    """The episode this sample belongs to, when an episode gave several samples (an agent that
    rewrote its history: envs/agent_trajectory.py); they share its reward and its GRPO
    advantage, and the group's baseline counts the episode once. -1: a sample of its own."""

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        sampled = n
        if self.loss_mask:
            if len(self.loss_mask) != n:
                raise ValueError(
                    f"sample has {n} completion tokens but a loss mask of {len(self.loss_mask)}"
                )
            if any(m not in (0, 1) for m in self.loss_mask):
                raise ValueError("loss_mask entries must be 0 (observation) or 1 (sampled)")
            sampled = sum(self.loss_mask)
        if len(self.behaviour_logprobs) != sampled or len(self.versions) != sampled:
            raise ValueError(
                f"sample has {sampled} sampled completion tokens but "
                f"{len(self.behaviour_logprobs)} logprobs and {len(self.versions)} versions"
            )
        self.routing_shape = tuple(self.routing_shape)  # type: ignore[assignment]  # JSON: a list
        if self.routed_experts:
            rows = len(self.prompt_ids) + n - 1
            num_layers, k = self.routing_shape
            per_row = num_layers * k
            if not per_row or len(self.routed_experts) not in (rows * per_row, 2 * rows * per_row):
                raise ValueError(
                    f"routed_experts holds {len(self.routed_experts)} bytes; {rows} positions x "
                    f"{num_layers} layers x top-{k} need {rows * per_row} (uint8) or "
                    f"{2 * rows * per_row} (int16)"
                )

    @property
    def oldest_version(self) -> int:
        """Version of the oldest sampled token (observation tokens have none); a sample with no
        sampled tokens counts as fresh."""
        return min(self.versions) if self.versions else 1 << 62

    @property
    def mask(self) -> list[int]:
        """The loss mask with the empty default spelled out (one entry per completion token)."""
        return self.loss_mask or [1] * len(self.completion_ids)

    @property
    def num_sampled(self) -> int:
        """Completion tokens the policy sampled (the rest are observations)."""
        return len(self.versions)


@dataclass
class Group:
    """The G samples of one task, as a worker acks it. Staleness is counted from the oldest token
    of any sample in the group."""

    task: TaskRef
    samples: list[Sample]
    worker_id: str = ""
    lease_id: int = -1

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]

    @property
    def oldest_version(self) -> int:
        return min(s.oldest_version for s in self.samples)


@dataclass
class Batch:
    """Groups handed to one trainer step, with the trainer version they were taken at."""

    groups: list[Group]
    trainer_version: int
    staleness: list[int] = field(default_factory=list)
    """Per group: trainer_version - oldest token version."""

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g.samples]

    @property
    def task_ids(self) -> list[int]:
        return [g.task.task_id for g in self.groups]


def rollout_room(max_inflight_tasks: int, max_held: int, generating: int, held: int) -> int:
    """How many more tasks a rollout worker may take: fewer than `max_inflight_tasks` generating,
    and fewer than `max_held` held in all (generating, or waiting on their rewards and environment
    steps: `rollout.max_inflight_tasks + rollout.max_scoring_tasks`, or fewer where a sandbox
    pool holds fewer groups). The worker (rl/worker.py), `bench rewards` and the planner's
    simulation (plan/sim.py) admit tasks by this one rule."""
    return min(max_inflight_tasks - generating, max_held - held)
