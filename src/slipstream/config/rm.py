"""`[rm]`: training a Bradley-Terry reward model (`slipstream rm train`), and `[reward]`: what the
rollout workers reward a completion with: `[[reward.functions]]`, a weighted sum of the task's
verifier, a reward model, math-verify, exact / regex matches and users' Python functions
(docs/rewards.md; the reward model: docs/rlhf.md)."""

import re
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

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


RewardKind = Literal["verifier", "reward_model", "math", "exact", "regex", "python"]
POOL_KINDS = ("math", "exact", "regex", "python")
"""Kinds that run in the reward worker processes (timeout, memory limit, kill and replace)."""
_FUNCTION_RE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$")


class RewardFunctionConfig(Section):
    """One `[[reward.functions]]` entry: a reward component (docs/rewards.md)."""

    name: str = Field(default="", max_length=64, pattern=r"^([A-Za-z_][\w.-]*)?$")
    """Unique name: the component's metrics (`reward/<name>/mean`, `/none`, ...) and errors.
    "" = the kind's name."""
    kind: RewardKind = "verifier"
    """"verifier": the task's own verifier (built-in tasks; the code task's sandboxed tests).
    "reward_model": sigmoid of a reward model's score (`reward.url` / `reward.model`). "math":
    Hugging Face math-verify of the completion against the reference answer (gold first).
    "exact": normalised string equality with the reference. "regex": `pattern`'s first capture
    group, normalised, equals the reference. "python": `function`, TRL's reward signature."""
    weight: float = Field(default=1.0, ge=-1000, le=1000)
    """The reward is the sum of weight x score over the components (a None score adds 0). 0 =
    computed and logged, not rewarded."""
    function: str = ""
    """kind = "python": "package.module:name", importable in the reward workers (the job's
    PYTHONPATH / working directory). TRL's signature: f(prompts, completions, **columns) ->
    list[float | None], plain or `async def`."""
    batched: bool = True
    """kind = "python": True = TRL's list signature; False = f(prompt, completion, **columns) ->
    float | None, one sample per call."""
    group: bool = False
    """kind = "python": score a whole group (the G completions of one prompt) in one call, once
    all of them finished (e.g. rank-based or diversity rewards)."""
    pattern: str = ""
    """kind = "regex": a Python regular expression with at least one capture group; the last
    match's first group is the answer."""
    answer_key: str = ""
    """math / exact / regex: the column holding the reference answer; "" = the task's reference
    answer (`meta["answer"]`: a dataset's `answer_key`, a built-in task's answer)."""
    gate: str = ""
    """Name of another (non-group) component: this one is computed only when that one scored
    >= 0.5, else it scores 0 (e.g. a reward model gated by the verifier)."""
    timeout_s: float = Field(default=10.0, gt=0, le=3600)
    """Wall-clock limit of one call in a reward worker (the process is killed and replaced past
    it); math-verify's own parse/verify timeouts are set just under it."""

    @field_validator("function")
    @classmethod
    def _function_path(cls, v: str) -> str:
        if v and not _FUNCTION_RE.match(v):
            raise ValueError(f"{v!r} is not 'package.module:name'")
        return v

    @model_validator(mode="after")
    def _kind_fields(self) -> "RewardFunctionConfig":
        if not self.name:
            self.name = self.kind
        where = f"reward function {self.name!r}"
        if self.kind == "python" and not self.function:
            raise ValueError(f"{where}: kind = 'python' needs function = 'package.module:name'")
        if self.kind != "python" and (self.function or self.group or not self.batched):
            raise ValueError(f"{where}: function, group and batched are for kind = 'python'")
        if self.kind == "regex":
            try:
                compiled = re.compile(self.pattern)
            except re.error as e:
                raise ValueError(f"{where}: pattern {self.pattern!r}: {e}") from None
            if compiled.groups < 1:
                raise ValueError(f"{where}: pattern {self.pattern!r} has no capture group")
        elif self.pattern:
            raise ValueError(f"{where}: pattern is for kind = 'regex'")
        if self.group and not self.batched:
            raise ValueError(f"{where}: group = true scores a list; it needs batched = true")
        return self


def legacy_functions(source: str, combine: str, verifier_weight: float,
                     rm_weight: float) -> list[RewardFunctionConfig]:  # fmt: skip
    """The `reward.functions` the shorthand keys `reward.source` / `combine` stand for. The
    task's verdict is always computed (weight 0 where it is not rewarded), as before."""
    v = RewardFunctionConfig(name="verifier", kind="verifier", weight=1.0)
    if source == "verifier":
        return [v]
    rm = RewardFunctionConfig(name="reward_model", kind="reward_model", weight=1.0)
    if source == "reward_model":
        return [v.model_copy(update={"weight": 0.0}), rm]
    if combine == "gate":
        return [v.model_copy(update={"weight": 0.0}), rm.model_copy(update={"gate": "verifier"})]
    return [v.model_copy(update={"weight": verifier_weight}),
            rm.model_copy(update={"weight": rm_weight})]  # fmt: skip


class RewardConfig(Section):
    functions: list[RewardFunctionConfig] = Field(default_factory=list, max_length=64)
    """The reward components (`[[reward.functions]]`); the reward is their weighted sum. Empty
    = what `source` / `combine` say (resolved at load: `slipstream config show` prints it)."""
    source: Literal["verifier", "reward_model", "combined"] = "verifier"
    """Shorthand for `functions` (kept for existing configs): the task's verifier; a reward
    model only (sigmoid of its score, in (0, 1)); or both (`combine`). Set either this or
    `functions`."""
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
    # ---- the reward worker processes (math, exact, regex, python) -------------------------------
    workers: int = Field(default=4, ge=1, le=256)
    """Reward worker processes per rollout worker: user code runs there, never in the rollout
    worker; calls run in parallel up to this many."""
    memory_bytes: int = Field(default=2 << 30, ge=256 << 20, le=1 << 40)
    """Address-space limit (RLIMIT_AS) of each reward worker process: past it allocations fail
    (a MemoryError is an error of that call, never a reward)."""
    retries: int = Field(default=2, ge=0, le=10)
    """A call that failed (raised, timed out, crashed its process, returned the wrong length, a
    non-number or a non-finite value) is retried this many times; then its group is dropped
    and counted."""
    max_consecutive_failures: int = Field(default=20, ge=1, le=1_000_000)
    """A function whose calls fail this many times in a row stops the job with a one-line
    error naming it (a broken function, not a hard sample)."""

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if not v:
            return v
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{v!r} is not an http(s)://host[:port] reward-model server")
        return v

    def verifier_only(self) -> bool:
        """Whether the reward is the task's verifier alone (the default)."""
        return self.functions == legacy_functions("verifier", "sum", 0.0, 0.0)

    def uses_reward_model(self) -> bool:
        """Whether a component is the reward model (it must be trained, served or reachable)."""
        return any(f.kind == "reward_model" for f in self.functions)

    @model_validator(mode="after")
    def _weights(self) -> "RewardConfig":
        derived = legacy_functions(self.source, self.combine, self.verifier_weight,
                                   self.rm_weight)  # fmt: skip
        if not self.functions:
            self.functions = derived
        elif self.source != "verifier" and self.functions != derived:
            raise ValueError(
                f"reward.source = {self.source!r} is the shorthand of reward.functions: set "
                "reward.functions alone (a 'reward_model' kind entry for the reward model)"
            )
        names = [f.name for f in self.functions]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"reward.functions: name {dupes[0]!r} is used twice")
        by_name = {f.name: f for f in self.functions}
        for f in self.functions:
            g = by_name.get(f.gate) if f.gate else None
            if f.gate and (g is None or g.group or g is f or f.group):
                raise ValueError(f"reward function {f.name!r}: gate {f.gate!r} must name "
                                 "another per-sample function of reward.functions")  # fmt: skip
        if self.server == "ray_actor" and (self.url or not self.uses_reward_model()):
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
