"""Trainer ranks beyond rank 0 for the local job (`trainer.num_processes` > 1).

Rank 0 is the job's own process: it runs the Controller (queue, buffer, weight publishing,
checkpoints, evaluation). Ranks 1..W-1 are follower processes started here: each builds its part
of the trainer with the same `build_trainer` (a whole replica, or its FSDP2 + EP shards per
[trainer.parallel]), then executes the commands rank 0 broadcasts, taking part in every
collective the command implies:

    ("resume", step | None)    load checkpoint `step` (sharded: its shards, resharded)
    ("step", batch)            Trainer.step on this rank's share of the batch
    ("publish",)               Trainer.full_state (sharded: the all-gathers; else nothing)
    ("save",)                  Trainer.save (sharded: this rank's shards; else nothing)
    ("stop",)                  leave

    ranks = TrainerRanks.start(cfg, init_checkpoint, log_dir)   # before the Trainer is built
    ranks.send(("step", batch)) ...                             # what Controller does
    ranks.close()

Backend: gloo on CPU, nccl when the run's device is CUDA (rank r uses cuda:r; not run here: no GPU).
Rendezvous over TCP on 127.0.0.1 (one machine). A follower dies with rank 0 (PR_SET_PDEATHSIG on
Linux); a follower that dies makes rank 0's next collective fail (gloo sees the closed
connection), and every collective is bounded by the process group's timeout,
`trainer.batch_timeout_s` + 60 s, so a lost rank fails the job instead of hanging it; the run
resumes from its last checkpoint when started again.

Not covered: several machines (the Ray launcher would place the ranks), gradient accumulation.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from slipstream.config import SlipstreamConfig
from slipstream.rl.types import TrainerRankLost
from slipstream.runtime import exit_distributed_process, resolve_device, set_threads

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_group(cfg: SlipstreamConfig, rank: int, address: str | None,
               local_gpu: int | None = None) -> torch.device:  # fmt: skip
    """Join the trainer ranks' process group at tcp://address as `rank` (None: `env://`, the
    store torchrun set up; launch/scheduled.py); -> this rank's device. On CUDA the rank uses
    cuda:<local_gpu> (default: cuda:<rank>, one machine)."""
    device = resolve_device(cfg.run)
    if device.type == "cuda":
        device = torch.device("cuda", rank if local_gpu is None else local_gpu)
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method="env://" if address is None else f"tcp://{address}",
        rank=rank,
        world_size=cfg.trainer.num_processes,
        timeout=datetime.timedelta(seconds=cfg.trainer.batch_timeout_s + 60),
    )
    return device


def broadcast_command(obj: Any) -> Any:
    """Rank 0: send `obj` to every rank; the others: receive it (pass None)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class TrainerRanks:
    """Rank 0's side: the follower processes and the command broadcast."""

    def __init__(self, procs: list[subprocess.Popen], log_dir: Path) -> None:
        self.procs = procs
        self.log_dir = log_dir

    def lost(self) -> TrainerRankLost | None:
        """An error naming the follower ranks that have exited (killed ones first: the others
        usually failed at the collective with them), or None while all run."""
        dead = [
            (r, p.returncode) for r, p in enumerate(self.procs, start=1) if p.poll() is not None
        ]
        if not dead:
            return None
        dead.sort(key=lambda rc: (rc[1] >= 0, rc[0]))  # signals (negative codes) first
        names = ", ".join(f"rank {r} (exit {code}; {self.log_dir / f'trainer-rank{r}.log'})"
                          for r, code in dead)  # fmt: skip
        return TrainerRankLost(f"trainer {names} ended during the run, so the step could not "
                               "complete; the job resumes from its last checkpoint when started "
                               "again")  # fmt: skip

    @classmethod
    def start(cls, cfg: SlipstreamConfig, init_checkpoint: str, log_dir: Path) -> TrainerRanks:
        """Spawn ranks 1..W-1 and join the process group as rank 0 (blocks until all joined)."""
        port = _free_port()
        log_dir.mkdir(parents=True, exist_ok=True)
        spec_path = log_dir / "dp_spec.json"
        spec_path.write_text(json.dumps({"config": cfg.model_dump(mode="json"),
                                         "init": init_checkpoint, "port": port}))  # fmt: skip
        procs = []
        for rank in range(1, cfg.trainer.num_processes):
            logf = open(log_dir / f"trainer-rank{rank}.log", "wb")  # noqa: SIM115 - child owns it
            cmd = [sys.executable, "-m", "slipstream.launch.dp", "--spec", str(spec_path),
                   "--rank", str(rank)]  # fmt: skip
            env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
            procs.append(subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env))
            logf.close()
        group = cls(procs, log_dir)
        try:
            join_group(cfg, 0, f"127.0.0.1:{port}")
        except BaseException:
            group.close()
            raise
        return group

    def send(self, command: tuple[Any, ...]) -> None:
        """Broadcast one command to the followers (see the module docstring); rank 0 then does
        its own part of it."""
        broadcast_command(command)

    def close(self, timeout_s: float = 30.0) -> list[int | None]:
        """Wait for the followers (after ("stop",)); kill any that do not exit; exit codes."""
        for p in self.procs:
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("trainer rank pid %d did not exit; killing", p.pid)
                p.kill()
                p.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
        return [p.returncode for p in self.procs]


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before prctl took effect
            os._exit(1)


def follower_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="slipstream.launch.dp")
    p.add_argument("--spec", required=True)
    p.add_argument("--rank", type=int, required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s rank{args.rank} %(levelname)s %(message)s")  # fmt: skip
    _die_with_parent()
    spec = json.loads(Path(args.spec).read_text())
    cfg = SlipstreamConfig.model_validate(spec["config"])
    set_threads(cfg.run)
    device = join_group(cfg, args.rank, f"127.0.0.1:{spec['port']}")
    return follow(cfg, spec["init"], device, args.rank)


def follow(cfg: SlipstreamConfig, init_checkpoint: str, device: torch.device, rank: int) -> int:
    """A follower rank's life after it joined the group: build its part of the trainer, then
    execute rank 0's commands until ("stop",). Returns 0. Every launcher's followers run this."""
    from slipstream.rl.trainer import build_trainer
    from slipstream.storage import open_stores
    from slipstream.tasks import get_taskset

    # Built as the Controller builds rank 0's, so every rank starts from the same state.
    trainer = build_trainer(cfg, init_checkpoint, device, get_taskset(cfg.task).tokenizer.pad_id)
    ckpts = open_stores(cfg).checkpoints
    num_steps = 0
    while (command := broadcast_command(None))[0] != "stop":
        match command:
            case ("resume", step):
                if step is not None:
                    trainer.restore(ckpts, step)
                    log.info("resumed from checkpoint step %d", step)
            case ("step", batch):
                trainer.step(batch)
                num_steps += 1
            case ("publish",):
                trainer.full_state()
            case ("save",):
                trainer.save(ckpts, None, {})
            case _:
                raise RuntimeError(f"rank {rank}: unknown command {command[0]!r} from rank 0")
    log.info("done after %d steps (version %d)", num_steps, trainer.version)
    return 0


if __name__ == "__main__":
    exit_distributed_process(follower_main(sys.argv[1:]))
