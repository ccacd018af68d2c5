"""The planner's rates file: a TOML document validated like every slipstream config.

Sections (all optional; defaults describe one trainer process and one rollout worker of the
quickstart on an idle host): `[loop]` (the RL algorithm's shape: batch, group size, staleness
bound), `[trainer]` (step-time model, nodes, price, `[trainer.ep]` expert-parallel traffic),
`[rollout]` (instances, worker settings, `[rollout.engine]` throughput model, `[rollout.spot]`
interruptions), `[verifier]` (latency distribution and concurrency), `[weights]` (store or
pushed weight versions, measured push times), `[sweep]` (what `slipstream
plan search` searches), `[calibration]` (where the numbers came from; free text, not used).

`load_rates(path, overrides)` fails with ConfigError naming key, value and file, like
`slipstream.config.load_config`; relative paths inside Dist tables are resolved against the
file's directory. `dump_toml(plan)` writes a file `load_rates` reads back to the same model.
Imports pydantic and numpy only (no torch).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from slipstream.config import staleness_bound
from slipstream.config.base import ConfigError, Section, load_model
from slipstream.plan.dists import Dist, resolve_paths


class LoopRates(Section):
    groups_per_step: int = Field(default=8, ge=1)
    """Groups (tasks) per trainer step (`trainer.groups_per_step` of the job)."""
    group_size: int = Field(default=8, ge=1)
    """G: samples per group (`rollout.group_size`)."""
    mode: Literal["sync", "one_step_off", "async"] = "async"
    """The job's `trainer.mode`: the staleness bound is 0, 1 or `max_staleness`."""
    max_staleness: int = Field(default=2, ge=0)
    """`buffer.max_staleness` (used in `async` mode)."""
    steps: int = Field(default=200, ge=1)
    """Trainer steps to simulate."""
    warmup_steps: int = Field(default=1, ge=0)
    """Steps excluded from the figures (pipeline fill, worker start-up)."""
    seed: int = 0
    """Seed of every random draw (same seed + same rates = same result)."""
    partial_rollouts: bool = True
    """Engines apply a new weight version at the next step boundary (`continue_new`); False: only
    when no sequence is running (`finish_old`), admitting nothing new meanwhile."""

    @property
    def staleness_bound(self) -> int:
        return staleness_bound(self.mode, self.max_staleness)

    @model_validator(mode="after")
    def _warmup_below_steps(self) -> LoopRates:
        if self.warmup_steps >= self.steps:
            raise ValueError(
                f"warmup_steps ({self.warmup_steps}) must be below steps ({self.steps})"
            )
        return self


class EPRates(Section):
    enabled: bool = False
    """Add expert-parallel all-to-all time to every trainer step (formula in plan/ep.py)."""
    dispatch: Literal["exact", "hierarchical"] = "hierarchical"
    """`exact`: one inter-node copy per remote expert (plain all-to-all); `hierarchical`: one per
    remote node (DeepEP normal mode: node-deduplicated dispatch, per-node partial-sum combine)."""
    num_experts: int = Field(default=256, ge=1)
    """Routed experts per MoE layer (E)."""
    top_k: int = Field(default=8, ge=1)
    """Experts per token (k)."""
    hidden_size: int = Field(default=7168, ge=1)
    """Hidden width of a token row (elements)."""
    num_moe_layers: int = Field(default=58, ge=1)
    """MoE layers a token passes."""
    ep_nodes: int = Field(default=8, ge=1)
    """Nodes one EP group spans (g); experts are sharded evenly over them."""
    gpus_per_node: int = Field(default=8, ge=1)
    """GPUs (ranks) per node; tokens of a step are spread over every trainer GPU."""
    bytes_per_element: float = Field(default=10.0, gt=0)
    """Bytes one element of a token row costs per layer summed over all the step's all-to-alls
    (e.g. FP8 dispatch 1 + BF16 combine 2 forward, 2 + 2 backward, 1 + 2 for the log-prob
    recompute = 10)."""
    inter_node_bytes_per_s_per_gpu: float = Field(default=50e9, gt=0)
    """Achieved inter-node bandwidth per GPU and direction (EFA 400 Gb/s = 50 GB/s line rate)."""
    overlap_fraction: float = Field(default=0.0, ge=0, le=1)
    """Share of the all-to-all time hidden behind compute (0 = none)."""

    @model_validator(mode="after")
    def _experts_split(self) -> EPRates:
        if self.num_experts % self.ep_nodes:
            raise ValueError(
                f"num_experts ({self.num_experts}) must be divisible by ep_nodes ({self.ep_nodes})"
            )
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) > num_experts ({self.num_experts})")
        return self


class TrainerRates(Section):
    num_nodes: int = Field(default=1, ge=1)
    """Trainer nodes (instances), on-demand; one data-parallel group that steps in lockstep."""
    reference_num_nodes: int = Field(default=1, ge=1)
    """Nodes at which `step_s` was measured or estimated."""
    parallel_fraction: float = Field(default=1.0, ge=0, le=1)
    """Amdahl: share of `step_s` that scales as reference_num_nodes / num_nodes."""
    step_s: Dist = Field(default_factory=lambda: Dist(kind="fixed", value=0.08))
    """Compute time of one optimizer step at reference_num_nodes (forward, backward, optimizer,
    and the weight publish when it was measured inside the step, as `train_s` of metrics.jsonl
    is), without expert-parallel communication."""
    publish_s: float = Field(default=0.0, ge=0)
    """Weight publish time per version on the trainer's critical path, if not in step_s."""
    overhead_s: float = Field(default=0.0, ge=0)
    """Per-step loop time that is neither training nor waiting (metrics, status)."""
    price_per_node_hour: float = Field(default=0.0, ge=0)
    """On-demand price of one trainer node ($/h; an input, never fetched)."""
    ep: EPRates = Field(default_factory=EPRates)
    """Expert-parallel all-to-all traffic of a step."""


class EngineRates(Section):
    step_fixed_s: float = Field(default=0.0027, ge=0)
    """Decode step time at zero rows (per-step overhead): step = slowdown * (fixed + per_token *
    tokens in the forward) / throughput_scale."""
    step_per_token_s: float = Field(default=0.000075, ge=0)
    """Added step time per token in the forward (a running row in a decode step, or a prompt
    token prefilled in a mixed step)."""
    slowdown: float = Field(default=1.0, gt=0)
    """Multiplies the engine's step time: the in-run slowdown `plan calibrate` fits against a
    run's measured request latency (weight and RPC times are measured as such, not scaled)."""
    throughput_scale: float = Field(default=1.0, gt=0)
    """Divides the engine step time: 1.4 = 40% more tokens/s at the same batch (DeepEP)."""
    max_batch_rows: int = Field(default=64, ge=1)
    """KV slots: most sequences decoded at once; a group is admitted whole."""
    token_quantum: int = Field(default=1, ge=1)
    """Tokens per simulated step (1 = every decode step; larger = faster, coarser)."""
    prompt_tokens: int = Field(default=8, ge=1)
    """Prompt length (tokens prefilled once per group)."""
    completion_tokens: Dist = Field(default_factory=lambda: Dist(kind="fixed", value=3.0))
    """Completion length in tokens, EOS included (rounded, clipped to [1, max_new_tokens]): one
    draw per sample, or one per group (see length_per)."""
    length_per: Literal["sample", "group"] = "sample"
    """`sample`: every sample draws its own length; `group`: the G samples of a group share one
    draw (short answers whose length the prompt fixes, e.g. arithmetic)."""
    max_new_tokens: int = Field(default=8, ge=1)
    """Completion length cap."""
    weight_fetch_s: float = Field(default=0.007, ge=0)
    """Time to fetch one version from the store (worker thread; generation continues)."""
    weight_apply_s: float = Field(default=0.0023, ge=0)
    """Time the engine pauses at a step boundary to apply a fetched version."""


class WeightRates(Section):
    """How a version reaches the engines (the job's `engine.weight_sync`; docs/weights.md)."""

    sync: Literal["store", "distributed"] = "store"
    """`store`: the trainer publishes (trainer.publish_s, if not in step_s), each instance's
    watcher finds the version within `rollout.weight_poll_s`, fetches it
    (rollout.engine.weight_fetch_s) and applies it at a step boundary (weight_apply_s).
    `distributed`: the trainer pushes every version to every live instance inside its step (the
    push, `push_s` at the number of live instances, is on its critical path; the synchronous
    store copy of every `store_every`-th version too); an instance has the version when the push
    returns and applies it at its next step boundary (weight_apply_s): no poll, no fetch."""
    push_s: list[tuple[int, float]] = Field(default_factory=list)
    """distributed: measured (engines, seconds) points of one version's push until every engine
    serves it, at `push_bytes` (`slipstream bench weights` rows: engines, distributed_s;
    `plan calibrate --weights-bench` reads them). Between points linear in the engine count;
    beyond the last, extended along the last two (one point: constant)."""
    push_bytes: int = Field(default=0, ge=0)
    """distributed: bytes of the version `push_s` was measured with."""
    version_bytes: int = Field(default=0, ge=0)
    """distributed: bytes of one version of the planned job (0 = push_bytes); the push times
    scale by version_bytes / push_bytes, which holds near the measured size only (a push also
    costs per request and per tensor: measure the job's own shape; docs/plan.md)."""
    store_every: int = Field(default=10, ge=1, le=100_000)
    """distributed: `engine.weight_store_every` (the first version is stored too)."""
    store_write_s: float = Field(default=0.0, ge=0)
    """distributed: the synchronous store write of a stored version (trainer's critical path)."""

    @model_validator(mode="after")
    def _distributed_is_measured(self) -> WeightRates:
        if self.sync != "distributed":
            return self
        if not self.push_s or self.push_bytes < 1:
            raise ValueError(
                "sync = 'distributed' needs push_s (measured (engines, seconds) points) and "
                "push_bytes: `slipstream plan calibrate --weights-bench BENCH.json` writes them "
                "from `slipstream bench weights`"
            )
        engines = [n for n, _ in self.push_s]
        if any(n < 1 for n in engines) or engines != sorted(set(engines)):
            raise ValueError(f"push_s engine counts must be >= 1 and increasing, got {engines}")
        if any(not (math.isfinite(t) and t > 0) for _, t in self.push_s):
            raise ValueError(f"push_s seconds must be finite and > 0, got {self.push_s}")
        return self

    def push_seconds(self, engines: int) -> float:
        """One version's push to `engines` live instances (see `push_s`)."""
        if engines < 1:
            return 0.0
        pts = self.push_s
        scale = (self.version_bytes or self.push_bytes) / self.push_bytes
        if len(pts) == 1 or engines <= pts[0][0]:
            return pts[0][1] * scale
        for (n0, t0), (n1, t1) in zip(pts, pts[1:], strict=False):
            if engines <= n1:
                return (t0 + (t1 - t0) * (engines - n0) / (n1 - n0)) * scale
        (n0, t0), (n1, t1) = pts[-2], pts[-1]
        return max(t1, t1 + (t1 - t0) * (engines - n1) / (n1 - n0)) * scale


class SpotRates(Section):
    interruptions_per_node_hour: float = Field(default=0.0, ge=0)
    """Poisson rate of Spot interruption notices per Spot node (an instance of m nodes is
    interrupted at m times this rate)."""
    notice_s: float = Field(default=120.0, ge=0)
    """Notice before the node is reclaimed (AWS: 2 minutes)."""
    drain_timeout_s: float = Field(default=20.0, ge=0)
    """`rollout.drain_timeout_s`: in-flight work may finish this long after the notice; the rest
    is nacked. If it exceeds notice_s the node is gone first: its leases expire after the TTL."""
    replace_s: float = Field(default=600.0, ge=0)
    """From reclaim to a replacement instance leasing again (capacity, pod start, model load)."""


class RolloutRates(Section):
    num_instances: int = Field(default=1, ge=1)
    """Rollout instances (a worker with its engine); `plan search` derives it from the split."""
    nodes_per_instance: int = Field(default=1, ge=1)
    """Nodes one instance spans (e.g. 2 for an EP16 inference server on 8-GPU nodes)."""
    max_inflight_tasks: int = Field(default=8, ge=1)
    """`rollout.max_inflight_tasks`: tasks one instance has generating."""
    max_scoring_tasks: int = Field(default=8, ge=0)
    """`rollout.max_scoring_tasks`: tasks an instance holds beyond max_inflight_tasks while
    they only wait on their verification."""
    tasks_per_lease: int = Field(default=4, ge=1)
    """`rollout.tasks_per_lease`."""
    lease_ttl_s: float = Field(default=30.0, gt=0)
    """`rollout.lease_ttl_s`: a dead instance's leases expire this long after its last heartbeat
    (heartbeats every min(ttl / 3, 1 s))."""
    weight_poll_s: float = Field(default=0.2, gt=0)
    """`rollout.weight_poll_s`: the weight watcher's period."""
    lease_rpc_s: float = Field(default=0.0003, ge=0)
    """Round trip of one coordinator call (stopping, lease, version) while the instance's engine
    is idle."""
    ack_rpc_s: float = Field(default=0.0003, ge=0)
    """Round trip of an ack call when rpc_busy_s is 0 (the group reaches the buffer when it
    returns)."""
    rpc_busy_s: float = Field(default=0.0, ge=0)
    """Round trip of a coordinator call while the instance's engine is stepping, and of every
    ack (the worker's verification threads and engine thread share one interpreter lock);
    0 = lease_rpc_s / ack_rpc_s."""
    lease_backoff_min_s: float = Field(default=0.005, gt=0)
    """First wait after a lease that returned nothing (the worker's loop: 5 ms, doubling)."""
    lease_backoff_max_s: float = Field(default=0.05, gt=0)
    """Cap of that wait (50 ms in the worker)."""
    startup_s: float = Field(default=0.0, ge=0)
    """Time from the start to an instance's first lease."""
    price_per_node_hour: float = Field(default=0.0, ge=0)
    """On-demand price of one rollout node ($/h)."""
    spot_price_per_node_hour: float = Field(default=0.0, ge=0)
    """Spot price of one rollout node ($/h)."""
    spot_fraction: float = Field(default=0.0, ge=0, le=1)
    """Share of the instances on Spot (rounded to whole instances); only these are interrupted."""
    engine: EngineRates = Field(default_factory=EngineRates)
    """Per-instance throughput model."""
    spot: SpotRates = Field(default_factory=SpotRates)
    """Spot interruptions (of the Spot share of the instances)."""

    @model_validator(mode="after")
    def _backoff(self) -> RolloutRates:
        if self.lease_backoff_max_s < self.lease_backoff_min_s:
            raise ValueError(
                f"lease_backoff_max_s ({self.lease_backoff_max_s}) < lease_backoff_min_s "
                f"({self.lease_backoff_min_s})"
            )
        return self


class VerifierRates(Section):
    latency_s: Dist = Field(default_factory=Dist)
    """Per-sample verification latency."""
    pool: Literal["per_instance", "shared"] = "per_instance"
    """`per_instance`: each rollout instance verifies with `concurrency_per_instance` threads (the
    worker's `rollout.verify_threads`); `shared`: one sandbox pool on CPU nodes serves everyone,
    with num_nodes * vcpus_per_node * density sandboxes, FIFO."""
    concurrency_per_instance: int = Field(default=64, ge=1)
    """per_instance: concurrent verifications per instance."""
    num_nodes: int = Field(default=0, ge=0)
    """shared: CPU nodes hosting sandboxes."""
    vcpus_per_node: int = Field(default=192, ge=1)
    """shared: vCPUs per CPU node."""
    density: float = Field(default=1.0, gt=0)
    """shared: sandboxes per vCPU (a `sweep` latency Dist is read at this density)."""
    price_per_node_hour: float = Field(default=0.0, ge=0)
    """Price of one CPU node ($/h)."""

    @model_validator(mode="after")
    def _shared_has_nodes(self) -> VerifierRates:
        if self.pool == "shared" and self.num_nodes < 1:
            raise ValueError("pool = 'shared' needs num_nodes >= 1")
        return self

    @property
    def num_sandboxes(self) -> int:
        return max(1, math.floor(self.num_nodes * self.vcpus_per_node * self.density))


class SweepRates(Section):
    total_nodes: int = Field(default=0, ge=0)
    """GPU nodes to split between trainer and rollout (0 = trainer + rollout nodes as given)."""
    train_nodes: list[int] = Field(default_factory=list)
    """Trainer node counts to try (the rest are rollout nodes); empty = every count that leaves
    whole rollout instances, in steps of nodes_per_instance."""
    densities: list[float] = Field(default_factory=list)
    """Sandbox densities to try at the best split (shared pool only; empty = as configured)."""
    spot_fractions: list[float] = Field(default_factory=list)
    """Spot fractions to try at the best split (empty = as configured)."""
    budget_per_hour: float = Field(default=0.0, ge=0)
    """Recommend the highest samples/s costing at most this ($/h); 0 = no budget."""
    target_samples_per_s: float = Field(default=0.0, ge=0)
    """Recommend the cheapest point reaching this samples/s; 0 = no target (with neither, the
    lowest cost per 1k trained samples)."""
    steps: int = Field(default=0, ge=0)
    """Trainer steps per simulated point (0 = loop.steps)."""
    variants: dict[str, list[str]] = Field(default_factory=dict)
    """Named what-if variants simulated at the configured split: name -> dotted overrides
    (e.g. {"no-deepep" = ["rollout.engine.throughput_scale=1.0", "trainer.ep.dispatch=exact"]})."""


class CalibrationInfo(Section):
    source: str = ""
    """Where the rates came from (a run directory, published figures)."""
    notes: list[str] = Field(default_factory=list)
    """Assumptions and measurements behind the numbers, one per line."""
    measured: dict[str, float] = Field(default_factory=dict)
    """Figures measured by `plan calibrate` (for the record; the simulator does not read them)."""


class PlanConfig(Section):
    """A planner rates file."""

    name: str = ""
    """Short name (used in output file names)."""
    description: str = ""
    """What this file describes."""
    loop: LoopRates = Field(default_factory=LoopRates)
    """The RL algorithm's shape: batch, group size, staleness bound, steps to simulate."""
    trainer: TrainerRates = Field(default_factory=TrainerRates)
    """Trainer nodes, step-time model, EP traffic, price."""
    rollout: RolloutRates = Field(default_factory=RolloutRates)
    """Rollout instances: worker settings, engine throughput, Spot."""
    verifier: VerifierRates = Field(default_factory=VerifierRates)
    """Verification latency and concurrency."""
    weights: WeightRates = Field(default_factory=WeightRates)
    """How versions reach the engines: the store, or pushed (measured push times)."""
    sweep: SweepRates = Field(default_factory=SweepRates)
    """What `slipstream plan search` searches and optimises."""
    calibration: CalibrationInfo = Field(default_factory=CalibrationInfo)
    """Where the numbers came from (not read by the simulator)."""

    @model_validator(mode="after")
    def _group_fits_the_engine(self) -> PlanConfig:
        if self.rollout.engine.max_batch_rows < self.loop.group_size:
            raise ValueError(
                f"rollout.engine.max_batch_rows ({self.rollout.engine.max_batch_rows}) is below "
                f"loop.group_size ({self.loop.group_size}): a group is admitted whole and would "
                "never fit"
            )
        return self


def _resolve(plan: PlanConfig, base_dir: Path) -> PlanConfig:
    plan.trainer.step_s = resolve_paths(plan.trainer.step_s, base_dir)
    plan.verifier.latency_s = resolve_paths(plan.verifier.latency_s, base_dir)
    eng = plan.rollout.engine
    eng.completion_tokens = resolve_paths(eng.completion_tokens, base_dir)
    return plan


def load_rates(path: str | Path | None = None, overrides: list[str] | None = None) -> PlanConfig:
    """Read and validate a rates file (+ dotted overrides). Raises ConfigError naming key, value
    and file; relative Dist paths are resolved against the file's directory."""
    plan = load_model(PlanConfig, path, overrides)
    base = Path(path).resolve().parent if path is not None else Path.cwd()
    return _resolve(plan, base)


def with_overrides(plan: PlanConfig, overrides: list[str]) -> PlanConfig:
    """A validated copy of `plan` with dotted overrides applied (ConfigError on a bad one)."""
    from pydantic import ValidationError

    from slipstream.config.base import apply_overrides, format_validation_error

    data = apply_overrides(plan.model_dump(mode="python"), overrides)
    try:
        return PlanConfig.model_validate(data)
    except ValidationError as e:
        origin = "overrides " + " ".join(overrides)
        raise ConfigError(format_validation_error(e, data, origin)) from None


# ---- TOML writer ---------------------------------------------------------------------------


def _toml_scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            raise ValueError(f"cannot write {v} to TOML")
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_scalar(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_key(k)} = {_toml_scalar(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _key(k: str) -> str:
    return k if k.replace("_", "").replace("-", "").isalnum() else _toml_scalar(k)


def _emit(data: dict[str, Any], prefix: str, out: list[str], tables: set[str]) -> None:
    scalars = {k: v for k, v in data.items() if not (isinstance(v, dict) and k in tables)}
    subs = {k: v for k, v in data.items() if isinstance(v, dict) and k in tables}
    if prefix:
        out.append(f"\n[{prefix}]")
    for k, v in scalars.items():
        if v is None:
            continue  # TOML has no null: absent = the default (None)
        out.append(f"{_key(k)} = {_toml_scalar(v)}")
    for k, v in subs.items():
        _emit(v, f"{prefix}.{k}" if prefix else k, out, _section_keys(v))


def _section_keys(data: dict[str, Any]) -> set[str]:
    return {k for k, v in data.items() if isinstance(v, dict) and k not in _INLINE_DICTS}


# Dict-valued fields that are data (inline tables), not sections.
_INLINE_DICTS = {"variants", "measured"}


def dump_toml(plan: PlanConfig, header: str = "") -> str:
    """TOML text for `plan` (None fields are left out, so they read back as their default)."""
    data = plan.model_dump(mode="json")
    out = [f"# {line}" if line else "#" for line in header.splitlines()]
    _emit(data, "", out, _section_keys(data))
    return "\n".join(out).lstrip("\n") + "\n"
