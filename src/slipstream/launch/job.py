"""The job driver of `slipstream run`: one RL job from start checkpoint to report.

    result = run_job(cfg)

    setup_start_checkpoint   model.init_from, else the SFT warm start (trained here if missing)
    setup_trainer_ranks      trainer.num_processes > 1: the other trainer ranks (replicas or shards)
    setup_controller         trainer, stores, coordinator; resume from the last checkpoint
    setup_launcher           the workers, placed by run.launcher (local processes or Ray actors)
    run                      controller.run() under a live display; SIGTERM unwinds cleanly
    teardown                 stop the workers (drain), then the trainer ranks
    report                   <run.output_dir>/report.md + reward_curve.png

It sits above the launchers (launch/base.py) and the controller (rl/controller.py) and knows
neither's internals.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from slipstream.config import SlipstreamConfig
from slipstream.launch.base import Launcher, make_launcher, start_trainer_ranks
from slipstream.rl.types import FollowerRanks


def setup_start_checkpoint(cfg: SlipstreamConfig, console: Any = None) -> str:
    """The policy the RL run starts from: model.init_from if set, else the SFT checkpoint under
    <run.output_dir>/sft/checkpoint, running the SFT warm start first when it is missing."""
    if cfg.model.init_from:
        return cfg.model.init_from
    from slipstream.sft import checkpoint_complete, run_sft, sft_dir

    ckpt = sft_dir(cfg) / "checkpoint"
    if not checkpoint_complete(ckpt):
        run_sft(cfg, console)
    return str(ckpt)


def setup_trainer_ranks(cfg: SlipstreamConfig, init: str) -> FollowerRanks | None:
    """The other trainer ranks when trainer.num_processes > 1 (placed per run.launcher), else
    None."""
    if cfg.trainer.num_processes == 1:
        return None
    return start_trainer_ranks(cfg, init, Path(cfg.run.output_dir) / "launch" / "logs")


def run_job(cfg: SlipstreamConfig, console: Any = None, *, display: bool = True) -> Any:
    """The whole job: warm start if needed, trainer here, workers placed by run.launcher, live
    display, final report. Returns the controller's RunResult."""
    from rich.console import Console

    from slipstream.observe.progress import RLProgress
    from slipstream.observe.prometheus import JobMetrics
    from slipstream.rl.controller import Controller
    from slipstream.runtime import set_threads

    console = console or Console()
    set_threads(cfg.run)
    init = setup_start_checkpoint(cfg, console)
    from slipstream.rm.train import ensure_reward_model

    ensure_reward_model(cfg, init, console)  # [reward] needs a local reward model: train it
    progress = RLProgress(console, plain=None if display else True)
    metrics = None  # run.metrics_port > 0: Prometheus /metrics (observe/prometheus.py)
    if cfg.run.metrics_port:
        metrics = JobMetrics(cfg.run.metrics_port, cfg.run.metrics_host)
    on_record = progress.update if metrics is None else metrics.chain(progress.update)
    dp = setup_trainer_ranks(cfg, init)
    try:
        controller = Controller(cfg, init, on_record=on_record, dp=dp)
        if metrics is not None:  # Prometheus reads the coordinator at scrape time
            metrics.watch(controller.coord)
            console.print(f"[bold]metrics[/] {metrics.url}")
        launcher = make_launcher(cfg, controller.coord)
    except BaseException:
        if dp is not None:
            dp.close(timeout_s=0)
        raise

    def on_sigterm(signum: int, frame: Any) -> None:
        # Trainer pod terminated: unwind so `finally` drains and stops the workers. The run
        # resumes from its last checkpoint when started again.
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        launcher.start()
    except BaseException:  # e.g. the sandbox backend check: nothing ran, undo what did
        signal.signal(signal.SIGTERM, previous)
        if dp is not None:
            dp.close(timeout_s=0)
        raise
    dp_codes = None
    try:
        with progress:
            result = controller.run()
    except Exception as e:  # re-raised: named as a lost rank when that is what it was
        lost = dp.lost() if dp is not None else None
        if lost is not None:
            raise lost from e
        raise
    finally:
        codes = launcher.stop()
        if metrics is not None:
            metrics.close()
        signal.signal(signal.SIGTERM, previous)
        if dp is not None:  # after a failure the ranks are blocked in a broadcast: kill them
            dp_codes = dp.close(timeout_s=30 if controller.dp_done else 0)
    report = write_job_report(cfg, result, controller, launcher, codes, dp_codes)
    console.print(f"[bold]report[/] {report} (reward curve: {report.parent / 'reward_curve.png'})")
    return result


def write_job_report(cfg: SlipstreamConfig, result: Any, controller: Any, launcher: Launcher,
                     codes: dict[int, int | None], dp_codes: list[int | None] | None) -> Path:  # fmt: skip
    """report.md + reward_curve.png under run.output_dir; -> the report's path."""
    from slipstream.observe.report import write_report

    summary = {
        "mode": cfg.trainer.mode, "steps": result.steps, "wall_s (RL loop)": result.wall_s,
        "held-out pass@1 before": result.pass_at_1_before, "held-out pass@1 after": result.pass_at_1_after,
        "samples/s": result.samples_per_s, "trainer idle fraction": result.trainer_idle_frac,
        "final batch reward": result.final_reward, "resumed from step": result.resumed_from,
        **launcher.summary(), "worker exit codes": codes,
        "buffer": controller.coord.buffer.metrics(),
    }  # fmt: skip
    if not cfg.reward.verifier_only():  # what the policy was trained against
        from slipstream.rm.source import reward_summary

        summary.update(reward_summary(cfg))
    if controller.skipped_checkpoints:
        summary["skipped checkpoints"] = controller.skipped_checkpoints
    if dp_codes is not None:
        summary["trainer processes (data parallel)"] = cfg.trainer.num_processes
        summary["trainer rank exit codes"] = dp_codes
    return write_report(cfg.run.output_dir, summary, result.records)
