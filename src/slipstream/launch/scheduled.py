"""A job whose processes a scheduler placed (`run.launcher = "torchx"`): the TorchX component
(launch/torchx.py) starts the trainer ranks with torchrun and the rollout workers as their own
role; this module is what those processes do once they run. It does not import TorchX.

    trainer role   torchrun ... --no-python slipstream run -c CONFIG --run.launcher=torchx ...
                   rank 0 (RANK=0): the job driver as always (launch/job.py); its launcher is
                   `ScheduledLauncher` (serves the coordinator, starts nothing) and its other
                   trainer ranks are `TorchrunRanks` (torchrun started them).
                   ranks > 0: `follower_main`: join the process group, then the same follower
                   loop as a local rank (launch/dp.py `follow`).
    rollout role   python -m slipstream.launch.worker --coordinator HOST:PORT --slot N -c CONFIG
                   (launch/worker.py): connects to rank 0's coordinator, then a rollout worker as
                   under any launcher.

What wires the roles together, set by the component in every role's environment:
`SLIPSTREAM_COORDINATOR_PORT` (rank 0 serves the coordinator on it) and
`SLIPSTREAM_COORDINATOR_AUTHKEY` (hex, at least 16 bytes; the coordinator's only guard: keep the
cluster network private; a bad one is a one-line error naming the variable). Workers find rank
0's host by the scheduler's name for trainer replica 0 (TorchX's rank-0 variable; Kubernetes:
the Volcano job's service name). Rank 0 binds the coordinator to one address, never all of them
(`coordinator_bind_host`): `SLIPSTREAM_COORDINATOR_HOST` (on Kubernetes the component sets the
pod's IP; on another scheduler whose workers run on other hosts, set it to rank 0's address on
the job's network), else `TORCHX_RANK0_HOST` (the name TorchX's local, Docker, LSF and Ray
schedulers give rank 0's host), else 127.0.0.1 (workers on rank 0's host only).

Trainer ranks: torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) say who is
who; the group is joined at `env://` (torchrun's store). WORLD_SIZE must equal
trainer.num_processes. A follower first waits for the start checkpoint: model.init_from, or the
SFT checkpoint rank 0 writes under run.output_dir (one machine or a shared directory; on
Kubernetes set model.init_from). A rank that ends makes torchrun's agent stop the others, and
the scheduler's retry (the trainer role's max_retries) restarts the job, which resumes from its
last checkpoint.

Rollout workers: the scheduler replaces a lost one (the rollout role's own max_retries); its
leases expire and are redelivered, the trainer keeps running. `stop()` sets the coordinator's
stop flag and keeps serving until the workers have drained and reported (their heartbeats stop),
so they exit 0 and the scheduler sees the job succeed.

Not covered: rank 0 cannot see the workers' exit codes (the scheduler has them), so the report
counts replaced workers from the worker ids it saw, not from exits.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, NoReturn

from slipstream.config import SlipstreamConfig
from slipstream.launch.dp import follow, join_group
from slipstream.launch.worker import (
    COORDINATOR_HOST_ENV,
    COORDINATOR_PORT_ENV,
    authkey_from_env,
    check_sandbox_backend,
)

log = logging.getLogger(__name__)

INIT_WAIT_S = 6 * 3600.0  # a follower waits this long for rank 0's SFT start checkpoint
QUIET_S = 3.0  # a worker whose heartbeat (about 1 s) stopped this long ago has left


def torchrun_rank() -> int | None:
    """This process's trainer rank when torchrun started it (RANK), else None."""
    rank = os.environ.get("RANK")
    return None if rank is None else int(rank)


TORCHX_RANK0_HOST_ENV = "TORCHX_RANK0_HOST"
"""Where TorchX's local, Docker, LSF and Ray schedulers put rank 0's host name ("localhost" on
the local ones); not set by the Slurm and cloud batch schedulers (a name of their own)."""


def coordinator_bind_host() -> str:
    """The one address rank 0 serves the coordinator on (see the module docstring): never
    0.0.0.0 unless asked for by name, since whoever reaches the port and holds the authkey
    runs code in rank 0 (the transport unpickles)."""
    explicit = os.environ.get(COORDINATOR_HOST_ENV, "").strip()
    if explicit:
        return explicit
    advertised = os.environ.get(TORCHX_RANK0_HOST_ENV, "").strip()
    if advertised:
        return advertised
    log.info("%s is not set: the coordinator binds 127.0.0.1 (rollout workers on this host "
             "only; set it to this host's address on the job's network for others)",
             COORDINATOR_HOST_ENV)  # fmt: skip
    return "127.0.0.1"


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise RuntimeError(
            f"run.launcher = 'torchx' needs {name} in the environment (the TorchX component "
            "src/slipstream/launch/torchx.py:rl sets it in every role)"
        )
    return value


def _check_world(cfg: SlipstreamConfig) -> tuple[int, int]:
    """-> (rank, local rank); ValueError when torchrun's world is not trainer.num_processes."""
    world = int(_env("WORLD_SIZE"))
    if world != cfg.trainer.num_processes:
        raise ValueError(
            f"trainer.num_processes = {cfg.trainer.num_processes}, but torchrun started "
            f"{world} trainer ranks (WORLD_SIZE): they must be equal (the component sets both "
            "from -j)"
        )
    return int(_env("RANK")), int(os.environ.get("LOCAL_RANK", "0"))


class TorchrunRanks:
    """Rank 0's side of the trainer ranks torchrun started (same interface as
    launch/dp.py TrainerRanks: send, lost, close)."""

    def __init__(self, world: int) -> None:
        self.world = world

    @classmethod
    def start(cls, cfg: SlipstreamConfig, init_checkpoint: str, log_dir: Path) -> TorchrunRanks:
        rank, local_rank = _check_world(cfg)
        if rank != 0:
            raise RuntimeError(f"TorchrunRanks.start on trainer rank {rank}: rank 0 drives the job")
        join_group(cfg, 0, None, local_gpu=local_rank)
        return cls(cfg.trainer.num_processes)

    def send(self, command: tuple[Any, ...]) -> None:
        from slipstream.launch.dp import broadcast_command

        broadcast_command(command)

    def lost(self) -> Exception | None:
        # torchrun's agent watches the ranks: one that ends stops the group, and the failed
        # collective is the error rank 0 reports
        return None

    def close(self, timeout_s: float = 30.0) -> list[int | None]:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        return [None] * (self.world - 1)  # their exit codes are torchrun's


def _wait_for_init(cfg: SlipstreamConfig) -> str:
    """The start checkpoint a follower builds from: model.init_from, else rank 0's SFT
    checkpoint once it is complete (polled; INIT_WAIT_S at most)."""
    if cfg.model.init_from:
        return cfg.model.init_from
    from slipstream.sft import checkpoint_complete, sft_dir

    ckpt = sft_dir(cfg) / "checkpoint"
    deadline = time.monotonic() + INIT_WAIT_S
    logged = False
    while not checkpoint_complete(ckpt):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"no complete SFT checkpoint at {ckpt} after {INIT_WAIT_S:.0f} s: rank 0 writes "
                "it; with ranks on several machines set model.init_from"
            )
        if not logged:
            log.info("waiting for rank 0's SFT start checkpoint at %s", ckpt)
            logged = True
        time.sleep(1.0)
    return str(ckpt)


def follower_main(cfg: SlipstreamConfig) -> NoReturn:
    """A trainer rank > 0 under torchrun: wait for the start checkpoint, join the group, follow
    rank 0's commands until ("stop",), then leave past gloo's exit race
    (runtime.exit_distributed_process)."""
    from slipstream.runtime import exit_distributed_process, set_threads

    rank, local_rank = _check_world(cfg)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s rank{rank} %(levelname)s %(message)s")  # fmt: skip
    set_threads(cfg.run)
    init = _wait_for_init(cfg)
    device = join_group(cfg, rank, None, local_gpu=local_rank)
    exit_distributed_process(follow(cfg, init, device, rank))


class ScheduledLauncher:
    """The rollout workers as rank 0 sees them when the scheduler placed them: it serves the
    coordinator where they look for it and starts nothing; see the module docstring."""

    def __init__(self, cfg: SlipstreamConfig, coordinator: Any, *, restart: bool = True) -> None:
        self.cfg = cfg
        self.coord = coordinator
        self.address: tuple[str, int] | None = None

    @property
    def num_restarts(self) -> int:
        """Worker incarnations seen beyond one per slot ("w<slot>.<generation>")."""
        ids = list(self.coord.worker_seen_s)
        return len(ids) - len({wid.rsplit(".", 1)[0] for wid in ids})

    def start(self) -> None:
        from slipstream.rl.coordinator import serve

        check_sandbox_backend(self.cfg)
        port = int(_env(COORDINATOR_PORT_ENV))
        authkey = authkey_from_env()
        host = coordinator_bind_host()
        self.address = tuple(serve(self.coord, authkey, port=port, host=host))
        log.info("coordinator served on %s:%d for the scheduled rollout workers", *self.address)

    def stop(self) -> dict[int, int | None]:
        """Tell the workers to stop, then keep serving until every worker seen has gone quiet
        (drained and reported) or rollout.drain_timeout_s + 10 s passed. The exit codes are the
        scheduler's: {}."""
        self.coord.request_stop()
        deadline = time.monotonic() + self.cfg.rollout.drain_timeout_s + 10
        while time.monotonic() < deadline:
            seen = list(self.coord.worker_seen_s.values())
            if not seen or time.time() - max(seen) > QUIET_S:
                break
            time.sleep(0.2)
        else:
            log.warning("rollout workers still reporting %.0f s after stop; leaving them",
                        self.cfg.rollout.drain_timeout_s + 10)  # fmt: skip
        return {}

    def summary(self) -> dict[str, Any]:
        return {"worker restarts": self.num_restarts,
                "rollout workers seen": sorted(self.coord.worker_seen_s)}  # fmt: skip
