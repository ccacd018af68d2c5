"""The RL main loop on the trainer side. It reads as the algorithm:

    setup: model from the starting checkpoint, Trainer, stores (weights + checkpoints),
           Coordinator (queue + buffer), resume from the latest checkpoint if any, publish
    loop:  batch <- coordinator.get_batch (staleness-bounded)      [trainer idle while waiting]
           metrics <- trainer.step(batch)                          [version += 1]
           publish: weights to the store, then the version to the coordinator
           log; evaluate every eval_every; checkpoint every checkpoint_every
    end:   stop workers, final evaluation, final checkpoint, report

Modes are one code path: the config resolves `trainer.mode` into `buffer.max_staleness` (sync 0,
one_step_off 1); the staleness bound and admission control do the rest.

Rollout workers are placed by a launcher (slipstream.launch); this module does not start them.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from slipstream.config import SlipstreamConfig
from slipstream.evaluate import heldout_pass_at_1
from slipstream.model import MoEForCausalLM, hf_config_from_model_config, hf_from_internal
from slipstream.observe.metrics import MetricsWriter
from slipstream.rewards.metrics import worker_error_totals
from slipstream.rl.buffer import ExperienceBuffer
from slipstream.rl.coordinator import Coordinator
from slipstream.rl.queue import TaskQueue
from slipstream.rl.trainer import build_trainer
from slipstream.rl.types import FollowerRanks
from slipstream.rl.weight_sync import make_weight_sync
from slipstream.runtime import resolve_device
from slipstream.storage import open_stores

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    steps: int
    wall_s: float
    pass_at_1_before: float | None
    pass_at_1_after: float | None
    samples_per_s: float
    trainer_idle_frac: float
    final_reward: float
    metrics_path: str
    resumed_from: int | None = None
    records: list[dict[str, Any]] = field(default_factory=list)


class Controller:
    """Trainer-side job. `on_record(record)` is called after every logged step (live display)."""

    def __init__(self, cfg: SlipstreamConfig, init_checkpoint: str, *,
                 on_record: Callable[[dict[str, Any]], None] | None = None,
                 evaluate: bool = True, dp: FollowerRanks | None = None) -> None:  # fmt: skip
        """`dp`: the other trainer ranks when trainer.num_processes > 1 (this process is rank
        0 of their process group; every step, publish, checkpoint and resume is broadcast to
        them first, so they take part in its collectives)."""
        from slipstream.tasks import get_taskset

        self.cfg = cfg
        self.on_record = on_record or (lambda r: None)
        self.evaluate = evaluate
        self.dp = dp
        self.dp_done = False  # the other ranks were told the run is over
        self.out_dir = Path(cfg.run.output_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.taskset = get_taskset(cfg.task)
        self.device = resolve_device(cfg.run)  # "auto" -> CUDA when torch sees one
        self.trainer = build_trainer(
            cfg, init_checkpoint, self.device, self.taskset.tokenizer.pad_id
        )
        self.model = self.trainer.model
        stores = open_stores(cfg)
        self.weights, self.ckpts = stores.weights, stores.checkpoints
        self.max_staleness = cfg.buffer.max_staleness
        tc = cfg.trainer
        queue = TaskQueue(self.taskset.num_train)
        bc = cfg.buffer
        buffer = ExperienceBuffer(
            tc.groups_per_step, self.max_staleness, dynamic_sampling=bc.dynamic_sampling,
            min_signal_share=bc.min_signal_share, signal_window_groups=bc.signal_window_groups,
        )  # fmt: skip
        self.coord = Coordinator(queue, buffer)
        self.resumed_from: int | None = None
        self.skipped_checkpoints: list[str] = []  # invalid newer checkpoints passed over
        self.pass_before: float | None = None
        self._eval_model: torch.nn.Module | None = None  # rank 0's full copy (sharded layouts)
        self._published: dict[str, torch.Tensor] | None = None
        self._maybe_resume()
        # engine.weight_sync: the store (Publisher) or pushes over a process group
        self.publisher = make_weight_sync(cfg, self.weights, self.coord)
        self.publish()
        self.publisher.flush()  # version 0 (or the resumed one) exists before any worker asks

    def _tell_ranks(self, *command: Any) -> None:
        """The other ranks do their part of what rank 0 does next (launch/dp.py)."""
        if self.dp is not None:
            self.dp.send(command)

    def publish(self) -> None:
        """Make the trainer's current version the policy: weights to the store first, then the
        version to the coordinator (workers load what it announces, so it must exist). With
        trainer.background_publish the writing overlaps the next step (rl/publisher.py)."""
        self._tell_ranks("publish")
        # the publisher copies the tensors before submit returns, so no snapshot here;
        # sharded: gathered from every rank into copies (kept for _policy_for_eval)
        state = self.trainer.full_state(copy=False)
        assert state is not None  # rank 0
        if self.trainer.ranks.sharded:
            self._published = state
        cfg = self.model.config
        dtype = next(iter(state.values())).dtype
        hf_state = hf_from_internal(state, cfg, fused_experts=self.publisher.fused_experts)
        self.publisher.submit(self.trainer.version, hf_state,
                              hf_config_from_model_config(cfg, dtype))  # fmt: skip

    def _policy_for_eval(self) -> torch.nn.Module:
        """The policy as one module: the trainer's own, or (sharded) a full copy on rank 0
        holding the last published weights."""
        if not self.trainer.ranks.sharded:
            return self.model
        assert self._published is not None
        if self._eval_model is None:
            with torch.device("meta"):
                self._eval_model = MoEForCausalLM(self.model.config)
        self._eval_model.load_state_dict(self._published, assign=True)
        self._eval_model.tie_weights()
        return self._eval_model

    def _maybe_resume(self) -> None:
        # the newest *valid* checkpoint; each newer invalid one is logged and passed over
        # (NoValidCheckpoint when checkpoints exist but none is valid)
        point = self.ckpts.latest_valid()
        self.skipped_checkpoints = point.warnings()
        step = point.step
        self._tell_ranks("resume", step)
        if step is None:
            return
        coord_state, manifest = self.trainer.restore(self.ckpts, step)
        self.ckpts.remove_after(step)  # the skipped bad ones: retention must never prefer them
        self.coord.restore(coord_state)
        self.pass_before = manifest.get("pass_at_1_before")
        gone = self.weights.remove_after(self.trainer.version)
        self.resumed_from = step
        log.warning("resumed from checkpoint step %d (version %d); unpublished versions %s",
                    step, self.trainer.version, gone)  # fmt: skip

    def _wait_for_batch(self, n: int, timeout_s: float) -> Any:
        """coord.get_batch, in slices: between them the weight sync hands the current version
        to engines that registered since it was pushed (`WeightSync.idle`), which the batch may
        be waiting on."""
        deadline = time.monotonic() + timeout_s
        while True:
            # staleness counts from the trainer's version (the coordinator's may lag one
            # version while it is being published)
            batch = self.coord.get_batch(n, min(1.0, max(0.0, deadline - time.monotonic())),
                                         version=self.trainer.version)  # fmt: skip
            if batch is not None or time.monotonic() >= deadline:
                return batch
            self.publisher.idle()

    def checkpoint(self) -> None:
        self.publisher.flush()  # the coordinator's version in the checkpoint is the trainer's
        self._tell_ranks("save")
        self.trainer.save(self.ckpts, self.coord.snapshot(), {"pass_at_1_before": self.pass_before})

    def _tensorboard(self):
        if importlib.util.find_spec("tensorboard") is None:
            return None
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(str(self.out_dir / "tensorboard"))

    def run(self) -> RunResult:
        cfg, tc = self.cfg, self.cfg.trainer
        metrics = MetricsWriter(
            self.out_dir / "metrics.jsonl", append=self.resumed_from is not None
        )
        tb = self._tensorboard()
        if self.evaluate and self.pass_before is None:
            self.pass_before = heldout_pass_at_1(self._policy_for_eval(), self.taskset, cfg)
        pass_now = self.pass_before
        self.on_record({"event": "start", "pass_at_1": pass_now, "step": self.trainer.step_count,
                        "steps": tc.steps})  # fmt: skip
        t_start = time.monotonic()
        idle_total = 0.0
        samples_total = 0
        records: list[dict[str, Any]] = []
        last_reward = float("nan")
        while self.trainer.step_count < tc.steps:
            t_wait = time.monotonic()
            batch = self._wait_for_batch(tc.groups_per_step, tc.batch_timeout_s)
            if batch is None:
                raise TimeoutError(
                    f"no batch of {tc.groups_per_step} groups within trainer.batch_timeout_s="
                    f"{tc.batch_timeout_s} s at version {self.trainer.version}: are the rollout "
                    f"workers alive? status {self.coord.status()}"
                )
            idle_s = time.monotonic() - t_wait
            idle_total += idle_s
            t_train = time.monotonic()
            self._tell_ranks("step", batch)  # the other ranks train their share of it
            m = self.trainer.step(batch)
            if not m["skipped"] and not math.isfinite(m["loss"]):
                raise FloatingPointError(
                    f"the loss is {m['loss']} at step {self.trainer.step_count}: the policy "
                    "diverged; nothing of this step is published"
                )
            self.publish()
            train_s = time.monotonic() - t_train
            samples_total += len(batch.samples)
            step = self.trainer.step_count
            evaluated = bool(self.evaluate and tc.eval_every and step % tc.eval_every == 0)
            eval_s = 0.0
            if evaluated:
                t_eval = time.monotonic()
                pass_now = heldout_pass_at_1(self._policy_for_eval(), self.taskset, cfg)
                eval_s = (
                    time.monotonic() - t_eval
                )  # inside elapsed_s: time-to-accuracy subtracts it
            elapsed = time.monotonic() - t_start
            status = self.coord.status()
            last_reward = m["reward_mean"]
            rec = {
                "step": step, "version": self.trainer.version, **m,
                "pass_at_1": pass_now, "evaluated": evaluated, "eval_s": eval_s, "idle_s": idle_s, "train_s": train_s,
                "staleness_max": max(batch.staleness), "staleness_mean": sum(batch.staleness) / len(batch.staleness),
                "task_ids": batch.task_ids, "elapsed_s": elapsed, "samples_total": samples_total,
                "samples_per_s": samples_total / max(elapsed, 1e-9),
                "trainer_idle_frac": idle_total / max(elapsed, 1e-9),
                "queue_pending": status.queue_pending_tasks, "queue_leased": status.queue_leased_tasks,
                "buffered": status.buffered_groups, "dropped_stale": status.dropped_stale_groups,
                "dropped_uniform": status.dropped_uniform_groups,
                "kept_uniform": status.buffer["kept_uniform"], "signal_share": status.buffer["signal_share"],
                "redelivered": status.redelivered_tasks,
                "rejected_acks": status.rejected_acks, "mode": tc.mode,
            }  # fmt: skip
            rec.update(worker_error_totals(self.coord.worker_stats))  # reward functions' errors
            if self.publisher.served_s:  # weight_sync = distributed: publish -> served, per engine
                rec["weight_served_s_max"] = max(self.publisher.served_s.values())
            metrics.log(**rec)
            if tb is not None:
                for k, v in rec.items():
                    if isinstance(v, int | float) and v is not None:
                        tb.add_scalar(f"rl/{k}", v, step)
            records.append(rec)
            self.on_record(rec)
            if tc.checkpoint_every and step % tc.checkpoint_every == 0:
                self.checkpoint()
        self.publisher.flush()  # the last version is in the store
        self.publisher.close()
        self.coord.request_stop()
        if self.dp is not None:  # the other ranks save with rank 0 below, then leave
            self.dp_done = True
        wall_s = time.monotonic() - t_start
        pass_after = None
        if self.evaluate:
            last = records[-1] if records else None
            if last is not None and last["evaluated"] and last["step"] == self.trainer.step_count:
                pass_after = last["pass_at_1"]  # just evaluated at the last step
            else:
                pass_after = heldout_pass_at_1(self._policy_for_eval(), self.taskset, cfg)
        if not tc.checkpoint_every or self.trainer.step_count % tc.checkpoint_every:
            self.checkpoint()
        self._tell_ranks("stop")
        final = {"event": "end", "pass_at_1": pass_after, "pass_at_1_before": self.pass_before,
                 "wall_s": wall_s, "step": self.trainer.step_count}  # fmt: skip
        metrics.log(**final, buffer=self.coord.buffer.metrics())
        self.on_record(final)
        metrics.close()
        if tb is not None:
            tb.close()
        return RunResult(
            steps=self.trainer.step_count, wall_s=wall_s, pass_at_1_before=self.pass_before,
            pass_at_1_after=pass_after, samples_per_s=samples_total / max(wall_s, 1e-9),
            trainer_idle_frac=idle_total / max(wall_s, 1e-9), final_reward=last_reward,
            metrics_path=str(self.out_dir / "metrics.jsonl"), resumed_from=self.resumed_from,
            records=[{"step": 0, "pass_at_1": self.pass_before, "evaluated": True}, *records,
                     {"step": self.trainer.step_count, "pass_at_1": pass_after, "evaluated": True}],
        )  # fmt: skip
