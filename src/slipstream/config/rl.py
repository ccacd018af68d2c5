"""`[rollout]`, `[buffer]`, `[trainer]`, `[store]`: the asynchronous RL loop."""

from typing import Any, Literal

from pydantic import Field, model_validator

from slipstream.config.base import Section
from slipstream.config.parallel import ParallelConfig


class RolloutConfig(Section):
    num_workers: int = Field(default=1, ge=1)
    """Rollout worker processes."""
    group_size: int = Field(default=8, ge=1)
    """G: samples per task (GRPO group)."""
    temperature: float = Field(default=1.0, ge=0, le=1e6)  # = engine.base.MAX_TEMPERATURE
    """Sampling temperature for rollouts."""
    max_new_tokens: int = Field(default=0, ge=0)
    """Completion length cap for rollouts; 0 = engine.max_new_tokens."""
    tasks_per_lease: int = Field(default=4, ge=1)
    """Tasks leased at once by a worker."""
    max_inflight_tasks: int = Field(default=8, ge=1)
    """Most tasks one worker has generating at once (over all its leases): a task counts from
    its lease until its requests have all returned from the engine (`GroupRollout.generating`;
    a multi-turn task again while a later turn generates)."""
    max_scoring_tasks: int = Field(default=8, ge=0)
    """Tasks a worker holds beyond `max_inflight_tasks` while they wait only on their
    environment steps (reward functions, verification, tool runs), so a slow reward overlaps
    the generation of newer tasks instead of holding a generation slot: a worker holds at most
    max_inflight_tasks + max_scoring_tasks tasks. 0: a task holds its slot until it is acked.
    Environments whose episodes hold a sandbox from reset hold no more tasks than the pool
    has sandboxes for (capacity // group_size; at least max_inflight_tasks of them)."""
    lease_ttl_s: float = Field(default=60.0, gt=0)
    """A lease not acked or extended within this time is redelivered. Workers extend their
    leases every lease_ttl_s / 3 while they are alive."""
    drain_timeout_s: float = Field(default=20.0, ge=0)
    """On SIGTERM, in-flight work may finish within this time; the rest is nacked."""
    partial_rollouts: bool = True
    """Apply a new weight version as soon as it is published, also to sequences mid-generation
    (their later tokens carry the new version). False: in-flight sequences finish on the weights
    they started with (the engine's `finish_old` policy)."""
    weight_poll_s: float = Field(default=0.2, gt=0)
    """How often a worker asks the weight store for a newer version."""
    verify_threads: int = Field(default=64, ge=1)
    """Concurrent verifications per worker (verifiers may be slow: sandboxes, test suites)."""
    verify_latency: Literal["none", "lognormal"] = "none"
    """Add artificial verifier latency (benchmarks): `lognormal` draws each verification's delay
    from a lognormal with median verify_latency_p50_s and p99/p50 = verify_latency_p99_over_p50."""
    verify_latency_p50_s: float = Field(default=0.05, ge=0)
    """Median artificial verifier latency (verify_latency = lognormal)."""
    verify_latency_p99_over_p50: float = Field(default=5.0, ge=1)
    """Tail ratio of the artificial verifier latency (p99 / p50)."""
    record_routing: bool = False
    """Have the engine record, per position and MoE layer, the experts it routed to, carried in
    each sample (for routing replay, and for the router-agreement metric). On when
    trainer.routing_replay = "r3" (resolved at load)."""
    seeded: bool = False
    """Deterministic sampling: each sample's seed is a function of (run.seed, task id, sample
    index), so a sync run is reproducible (used by the kill-and-resume determinism test)."""
    drain_file: str = ""
    """Ray launcher: when this file exists on an actor's node, the rollout actor drains as a
    worker process does on SIGTERM (stop leasing, finish or nack in-flight tasks, exit 0); an
    actor placed on that node afterwards does not start work there and is re-placed every
    restart_backoff_s. A Kubernetes preStop hook creates it when a Spot node is reclaimed
    (deploy/kuberay/rayjob.yaml). Empty: off."""
    sandbox_agent: str = Field(default="", pattern=r"^(unix:///\S+)?$")
    """Lease sandboxes from the node's host agent (`slipstream sandbox serve`) over its Unix
    socket, `unix:///path/to/socket`: one warm pool and one admission limit per node, shared by
    every worker there (docs/sandbox.md, "Host agent"). The agent must serve this job's
    [sandbox] template. Empty: each rollout worker owns an in-process SandboxPool."""
    max_start_failures: int = Field(default=5, ge=1)
    """A worker slot whose worker ends this many times in a row before it ever reaches the
    coordinator is crash-looping: the job fails with the worker's last output (launch/supervise.py).
    Workers lost after they started (killed, node gone) are always replaced."""
    restart_backoff_s: float = Field(default=1.0, gt=0)
    """Wait before restarting a worker that failed to start; doubles with each failure in a row."""
    restart_backoff_max_s: float = Field(default=30.0, gt=0)
    """Cap of that wait (at least restart_backoff_s)."""
    max_turns: int = Field(default=8, ge=1)
    """Most model turns per episode (multi-turn environments, task.env); single-turn
    environments end after one."""
    max_episode_tokens: int = Field(default=0, ge=0)
    """Most completion tokens of an episode, sampled and observation tokens together; 0 = what
    the engine's context leaves after the prompt. Each turn samples at most max_new_tokens."""
    max_observation_tokens: int = Field(default=64, ge=1)
    """Most tokens of one observation (tool output is capped to fit: head and tail kept)."""
    turn_timeout_s: float = Field(default=30.0, gt=0)
    """Most seconds one tool run in an episode's sandbox may take (then its processes are killed
    and the observation says so)."""
    episode_timeout_s: float = Field(default=300.0, gt=0)
    """Wall-clock bound of an episode, checked between turns: past it the next turn is the last."""
    max_infra_retries: int = Field(default=2, ge=0)
    """An episode that hits an infrastructure failure (no sandbox in time, the pool stopped, its
    sandbox died, no verdict) is re-run from the start up to this many times; one more and its
    task is dropped (counted in the buffer's `dropped_infra`), never trained with a made-up
    reward."""

    @model_validator(mode="after")
    def _backoff_cap(self) -> "RolloutConfig":
        if self.restart_backoff_max_s < self.restart_backoff_s:
            raise ValueError(
                f"rollout.restart_backoff_max_s ({self.restart_backoff_max_s}) must be at least "
                f"rollout.restart_backoff_s ({self.restart_backoff_s})"
            )
        return self


class BufferConfig(Section):
    max_staleness: int = Field(default=2, ge=0)
    """Most policy versions a trained token may lag the trainer in `async` mode (counted from the
    oldest token of a group). `trainer.mode` = `sync` resolves it to 0 and `one_step_off` to 1 when
    the config loads (whatever was written here); `async` uses the value given."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal (no GRPO signal); admission control over-samples
    to keep batches full, while refilling is affordable (`min_signal_share`)."""
    min_signal_share: float = Field(default=0.1, gt=0.0, le=1.0)
    """Dynamic sampling drops a uniform group only while at least this share of the last
    `signal_window_groups` groups carried signal (refilling then costs at most 1/share generated
    groups per trained one); below it uniform groups are trained, as without dynamic sampling, so
    a random initialisation or a mastered task never stalls the trainer."""
    signal_window_groups: int = Field(default=64, ge=1)
    """Groups (kept or dropped) the signal share is measured over; nothing is dropped until the
    window is full."""


class TrainerConfig(Section):
    mode: Literal["sync", "one_step_off", "async"] = "async"
    """`sync`: generate then train; `one_step_off`: staleness 1; `async`: bounded by max_staleness."""
    steps: int = Field(default=60, ge=0)
    """RL optimizer steps."""
    groups_per_step: int = Field(default=8, ge=1)
    """Groups (tasks) per training batch."""
    num_processes: int = Field(default=1, ge=1)
    """Trainer processes (ranks) on this machine (torch.distributed: gloo on CPU, nccl with one
    GPU per rank on CUDA). Rank 0 runs the loop (queue, buffer, weights, checkpoints, eval); the
    others get each batch from it and train their share. groups_per_step must divide evenly.
    How they split the model: [trainer.parallel] (default: plain replicas)."""
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    """The ranks' layout: data-parallel replicas, FSDP2 sharding, expert parallelism."""
    ep_dispatcher: Literal["padded", "exact", "hierarchical", "deepep"] = "exact"
    """How tokens reach their experts when parallel.ep > 1 (slipstream.moe): `exact` (all-to-all
    of exactly the rows each rank needs), `padded` (fixed capacity, drops counted), `hierarchical`
    (one inter-node copy per destination node, fan-out inside the node, as DeepEP), `deepep`
    (DeepEP's kernels: CUDA only, never run here)."""
    lr: float = Field(default=1e-4, gt=0)
    """Peak learning rate (AdamW)."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After warm-up: constant, or cosine decay to lr * min_lr_ratio at the last step."""
    warmup_steps: int = Field(default=0, ge=0)
    """Linear warm-up steps."""
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    """Cosine schedule floor as a fraction of lr."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay (matrices only)."""
    grad_clip: float = Field(default=1.0, gt=0)
    """Max global gradient norm."""
    adam_beta2: float = Field(default=0.999, gt=0, lt=1)
    """AdamW beta2. High on purpose: RL gradients are sparse (many all-equal groups), and a fast
    second-moment decay lets Adam blow tiny gradients (e.g. only the router aux loss) up to full
    lr-sized steps that wreck the policy."""
    skip_no_signal: bool = True
    """GRPO: skip the optimizer step when every advantage in the batch is zero (all groups have
    equal rewards), for the same reason; the version still advances."""
    routing_replay: Literal["off", "r3"] = "off"
    """`r3` (rollout routing replay): every MoE layer of the trainer's forward routes each
    position to the experts the engine routed it to (recorded by the engine, carried by the
    sample), with gate weights recomputed from the live router at those experts, so the
    gradient is taken through the experts that produced the sample while the router still
    learns. Each position replays the routing of the policy version that produced it (partial
    rollouts mix versions). Resolves rollout.record_routing on. `off`: the live router's top-k."""
    freeze_router: bool = False
    """Do not train the MoE routers (their weights stay at the starting checkpoint's): routing
    drift under noisy RL updates cost held-out accuracy on the quickstart (docs/rl.md)."""
    loss: Literal["grpo", "ppo"] = "grpo"
    """Policy-gradient objective: GRPO (group-relative advantages) or PPO (value head + GAE)."""
    std_norm: bool = True
    """GRPO: divide group-centred rewards by the group's std (Dr. GRPO turns this off)."""
    clip_low: float = Field(default=0.2, ge=0)
    """Ratio clip below 1 (1 - clip_low)."""
    clip_high: float = Field(default=0.28, ge=0)
    """Ratio clip above 1 (1 + clip_high); > clip_low is DAPO's clip-higher."""
    aggregation: Literal["token_mean", "seq_mean"] = "token_mean"
    """Loss aggregation over tokens: token_mean (DAPO) or seq_mean (original GRPO)."""
    is_cap: float = Field(default=2.0, ge=0)
    """Truncated importance sampling: weight = min(pi_proximal / pi_behaviour, is_cap); 0 = off."""
    kl_coef: float = Field(default=0.0, ge=0)
    """Weight of the k3 KL penalty to the reference (starting) policy; 0 = no reference model."""
    entropy_coef: float = Field(default=0.0, ge=0)
    """Entropy bonus weight."""
    num_minibatches: int = Field(default=1, ge=1)
    """Optimizer steps per batch (the batch is split); > 1 makes the ratio clip active."""
    ppo_gamma: float = Field(default=1.0, ge=0, le=1)
    """PPO: discount."""
    ppo_lambda: float = Field(default=0.95, ge=0, le=1)
    """PPO: GAE lambda."""
    value_coef: float = Field(default=0.5, ge=0)
    """PPO: weight of the clipped value loss."""
    value_clip: float = Field(default=0.2, gt=0)
    """PPO: value clip range."""
    value_lr: float = Field(default=0.0, ge=0)
    """PPO: critic learning rate; 0 = lr."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Compute dtype of the trainer's forward and backward; weights, gradients and optimizer
    state stay in run.dtype (float32 master weights) on every layout. `bf16`/`fp16`: one process
    and replicas run under autocast (matmuls, SDPA and the grouped experts in that dtype; norms,
    softmaxes and losses in float32); the sharded layout also gathers parameters in that dtype
    and reduces gradients in float32 (FSDP2 `MixedPrecisionPolicy(param_dtype, reduce_dtype =
    float32)`). `fp16` scales the loss (`torch.amp.GradScaler`; a step whose gradients overflow
    is skipped and reported as `grad_scale_skipped`). The old key `trainer.bf16 = true` is read
    as `precision = "bf16"`."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of keeping them (per-block
    activation checkpointing, `torch.utils.checkpoint`): less memory for one more forward."""
    compile_blocks: bool = False
    """Compile each decoder layer with `torch.compile` (regional, as torchtitan; dynamic shapes,
    since the packed token count changes every step). CUDA only (an error elsewhere): the
    kernels it fuses are launch overhead on a GPU; on this project's CPUs it only adds compile
    time. Never run here (no GPU in the sessions that wrote it; docs/gpu.md)."""
    logits_chunk_tokens: int = Field(default=4096, ge=0, le=1_048_576)
    """Token positions per chunk of the LM head + log-softmax in the trainer's loss
    (model/lm_loss.py): the float32 (B, T, V) logits are never materialised, only one chunk's
    (chunk, V); backward recomputes each chunk. 0: the full logits (the reference path)."""
    eval_every: int = Field(default=0, ge=0)
    """Held-out pass@1 every this many steps (0 = only before and after the run)."""
    background_publish: bool = True
    """Write each new weight version to the store from a background thread while the next step
    trains (rl/publisher.py): the coordinator announces a version once it is written, so it can
    lag the trainer by one version. False: publish inside the step."""
    checkpoint_every: int = Field(default=10, ge=0)
    """Write a resumable checkpoint every this many steps (0 = only at the end)."""
    deterministic: bool = False
    """Reproducible run: needs `mode = "sync"` and turns on rollout.seeded (resolved at load), so
    every sample's seed is a function of (run.seed, task id) and the weights that produced it
    are fixed by the sync schedule; a killed and resumed run then reproduces per-step losses on
    the same machine. Not covered: verification order (rewards do not depend on it) and kernels
    that are nondeterministic on CUDA."""
    batch_timeout_s: float = Field(default=600.0, gt=0)
    """Fail loudly when no batch arrives for this long (workers dead or stuck)."""

    @model_validator(mode="before")
    @classmethod
    def _bf16_alias(cls, data: Any) -> Any:
        """`trainer.bf16` (before `precision` existed): true means precision = "bf16"."""
        if isinstance(data, dict) and "bf16" in data:
            data = dict(data)
            bf16 = data.pop("bf16")
            if not isinstance(bf16, bool):
                raise ValueError(f"trainer.bf16 = {bf16!r}: expected true or false")
            if bf16 and data.get("precision", "bf16") != "bf16":
                raise ValueError(
                    f"trainer.bf16 = true contradicts trainer.precision = "
                    f"{data['precision']!r} (bf16 is the old spelling of precision = 'bf16')"
                )
            if bf16:
                data["precision"] = "bf16"
        return data

    @model_validator(mode="after")
    def _groups_split_over_ranks(self) -> "TrainerConfig":
        if self.groups_per_step % self.num_processes:
            raise ValueError(
                f"trainer.groups_per_step ({self.groups_per_step}) must be a multiple of "
                f"trainer.num_processes ({self.num_processes}): each rank trains an equal share"
            )
        par = self.parallel
        if par.dp_replicate == 0:  # resolved here, once: the replicas are what is left
            if self.num_processes % (par.dp_shard * par.ep):
                raise ValueError(
                    f"trainer.parallel: dp_shard ({par.dp_shard}) x ep ({par.ep}) must divide "
                    f"trainer.num_processes ({self.num_processes})"
                )
            par.dp_replicate = self.num_processes // (par.dp_shard * par.ep)
        return self


class StoreConfig(Section):
    url: str = ""
    """Where weights and checkpoints go: a path, file://..., or s3://bucket/prefix. Empty means
    <run.output_dir>/store."""
    keep_last: int = Field(default=3, ge=1)
    """Weight versions kept."""
    keep_checkpoints: int = Field(default=2, ge=1)
    """Trainer checkpoints kept."""
    endpoint_url: str = ""
    """S3 endpoint (MinIO, moto, ...); empty = AWS's default."""
