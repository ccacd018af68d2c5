"""The `Launcher` seam: what places the rollout workers of a job, and its factory.

    launcher = make_launcher(cfg, coordinator)     # keyed by run.launcher: "local" | "ray" | "torchx"
    launcher.start()                               # workers start; supervision begins
    ...                                            # the controller runs the loop
    codes = launcher.stop()                        # drain, then stop; {slot: exit code}

Every launcher builds its workers with launch/worker.py and supervises them with the one policy
of launch/supervise.py; the job driver (launch/job.py) never knows which launcher it has. The
trainer ranks beyond rank 0 are placed by the same switch (`start_trainer_ranks`): processes here
(launch/dp.py) or actors of a Ray placement group (launch/ray_ranks.py).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Protocol

from slipstream.config import SlipstreamConfig
from slipstream.rl.types import FollowerRanks

LAUNCHERS = {
    "local": "slipstream.launch.local:LocalLauncher",
    "ray": "slipstream.launch.ray:RayLauncher",  # the `ray` extra
    "torchx": "slipstream.launch.scheduled:ScheduledLauncher",  # roles placed by TorchX
}
TRAINER_RANKS = {
    "local": "slipstream.launch.dp:TrainerRanks",  # processes on this machine
    "ray": "slipstream.launch.ray_ranks:RayTrainerRanks",  # actors of a placement group
    "torchx": "slipstream.launch.scheduled:TorchrunRanks",  # processes torchrun started
}


class Launcher(Protocol):
    """Places `rollout.num_workers` rollout workers and keeps them running until `stop()`."""

    @property
    def num_restarts(self) -> int:
        """Workers replaced after they ended (not counting the first start of each slot)."""
        ...

    def start(self) -> None:
        """Serve the coordinator to the workers, start them, begin supervision. Raises (having
        started nothing that outlives the call) when the workers cannot run here."""
        ...

    def stop(self) -> dict[int, int | None]:
        """Ask the workers to drain, wait, then force the stragglers; -> {slot: exit code}
        (None: killed)."""
        ...

    def summary(self) -> dict[str, Any]:
        """Launcher facts for the run's report (restarts, re-placements, ...)."""
        ...


def start_trainer_ranks(
    cfg: SlipstreamConfig, init_checkpoint: str, log_dir: Path
) -> FollowerRanks:
    """Start ranks 1..W-1 where run.launcher places them, and join their process group as rank 0
    (blocks until all joined)."""
    mod, cls = TRAINER_RANKS[cfg.run.launcher].split(":")
    return getattr(importlib.import_module(mod), cls).start(cfg, init_checkpoint, log_dir)


def make_launcher(cfg: SlipstreamConfig, coordinator: Any, *, restart: bool = True) -> Launcher:
    """The launcher `run.launcher` names, for the job's coordinator. `restart=False` leaves
    ended workers ended (tests)."""
    mod, cls = LAUNCHERS[cfg.run.launcher].split(":")
    return getattr(importlib.import_module(mod), cls)(cfg, coordinator, restart=restart)
