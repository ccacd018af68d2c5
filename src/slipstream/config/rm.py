"""`[rm]`: training a Bradley-Terry reward model (`slipstream rm train`), and `[reward]`: where the
rollout workers' rewards come from (the task's verifier, a reward model, or both). docs/rlhf.md."""

from typing import Literal

from pydantic import Field, model_validator

from slipstream.config.base import Section


class RMConfig(Section):
    pairs: str = ""
    """Preference pairs, JSON lines {"prompt", "chosen", "rejected"} (text; the scored sequence is
    BOS + prompt + completion). "" = <run.output_dir>/rm/pairs.jsonl, made from the task by
    `slipstream rm pairs` (or by `rm train` when it is missing)."""
    init: str = ""
    """Backbone to start from: an HF-format causal-LM or sequence-classification directory. "" =
    the SFT checkpoint <run.output_dir>/sft/checkpoint when it exists, else a random [model]."""
    steps: int = Field(default=300, ge=0, le=1_000_000)
    """Optimizer steps (0 saves the initial model)."""
    batch_size: int = Field(default=32, ge=1, le=4096)
    """Preference pairs per step."""
    lr: float = Field(default=3e-4, gt=0, le=1.0)
    """Peak AdamW learning rate (linear warm-up, then constant)."""
    warmup_steps: int = Field(default=10, ge=0, le=1_000_000)
    """Linear warm-up steps of the learning rate."""
    weight_decay: float = Field(default=0.0, ge=0, le=1.0)
    """AdamW weight decay."""
    grad_clip: float = Field(default=1.0, gt=0, le=1e6)
    """Max global gradient norm."""
    heldout_fraction: float = Field(default=0.1, gt=0, lt=1)
    """Share of the pairs (after a seeded shuffle) kept out of training; pairwise accuracy on
    them (reward(chosen) > reward(rejected)) is the figure `rm train` reports."""
    log_every: int = Field(default=20, ge=1, le=1_000_000)
    """Write a metrics line (rm/metrics.jsonl) every this many steps."""
    # ---- pairs made from the task (`slipstream rm pairs`) --------------------------------------
    pair_prompts: int = Field(default=2000, ge=1, le=10_000_000)
    """Train tasks sampled from (the first this many)."""
    pair_samples: int = Field(default=8, ge=2, le=256)
    """Completions sampled per prompt from the SFT checkpoint (at pair_temperature); each prompt
    with at least one passing and one failing completion gives one pair per failing one."""
    pair_temperature: float = Field(default=1.0, gt=0, le=4.0)
    """Sampling temperature of those completions. Above 1 the SFT model also produces the odd,
    malformed answers an RL policy drifts to, so the pairs teach the RM to rank them low too."""
    label_noise: float = Field(default=0.1, ge=0, le=0.5)
    """Share of pairs whose chosen/rejected are swapped (a seeded coin per pair): the stated
    noise of the preference labels (human labels disagree ~20-30% on real data)."""


class RewardConfig(Section):
    source: Literal["verifier", "reward_model", "combined"] = "verifier"
    """Where a completion's reward comes from: the task's verifier; a reward model only
    (sigmoid of its score, in (0, 1)); or both (`combine`)."""
    combine: Literal["sum", "gate"] = "sum"
    """For source = "combined": "sum" = verifier_weight x verifier + rm_weight x sigmoid(score);
    "gate" = sigmoid(score) when the verifier passes (reward >= 0.5), else 0."""
    verifier_weight: float = Field(default=0.5, ge=0, le=100)
    """combine = "sum": weight of the verifier's reward."""
    rm_weight: float = Field(default=0.5, ge=0, le=100)
    """combine = "sum": weight of sigmoid(RM score)."""
    url: str = ""
    """A running reward-model server (`slipstream serve --model RM_DIR`: POST /classify), e.g.
    http://10.0.0.5:30001. "" = score in each rollout worker's process (`model`)."""
    model: str = ""
    """The reward model (HF sequence-classification directory) for in-process scoring. "" =
    <run.output_dir>/rm/checkpoint."""
    server: Literal["none", "ray_actor"] = "none"
    """"ray_actor" (run.launcher = "ray", reward.url empty): the launcher serves `model` from one
    Ray actor of its own (`server_resources`; POST /classify on its node's IP) and points every
    rollout actor's reward.url at it. "none": reward.url, else in-process scoring."""
    server_resources: dict[str, float] = Field(default_factory=lambda: {"CPU": 1.0})
    """Ray resources of that actor, e.g. {"GPU": 1} (placed on a node that has them)."""
    timeout_s: float = Field(default=30.0, gt=0, le=3600)
    """A scoring call (HTTP request or in-process batch) that takes longer is an infrastructure
    failure: never a reward (the episode is re-run, its task requeued)."""
    max_batch: int = Field(default=64, ge=1, le=4096)
    """Most completions one scoring call carries; concurrent completions of all of a worker's
    groups are batched together up to this."""
    batch_window_s: float = Field(default=0.005, ge=0, le=1.0)
    """How long a scoring call waits for more completions to join its batch."""

    @model_validator(mode="after")
    def _weights(self) -> "RewardConfig":
        if self.server == "ray_actor" and (self.url or self.source == "verifier"):
            raise ValueError(
                "reward.server = 'ray_actor' serves the reward model for the workers: it needs "
                "reward.source = 'reward_model' or 'combined' and an empty reward.url"
            )
        for key, amount in self.server_resources.items():
            if not 0 <= amount <= 1024:
                raise ValueError(
                    f"reward.server_resources[{key!r}] = {amount} is outside [0, 1024]"
                )
        if self.source == "combined" and self.combine == "sum":
            if self.verifier_weight + self.rm_weight == 0:
                raise ValueError(
                    "reward.verifier_weight + reward.rm_weight must be > 0 for "
                    "reward.source = 'combined' with combine = 'sum'"
                )
        return self
