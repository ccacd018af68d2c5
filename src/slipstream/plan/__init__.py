"""`slipstream plan`: a capacity planner for the asynchronous RL loop (docs/plan.md).

A discrete-event simulator (`sim.Simulator`) of trainer, coordinator (`slipstream.rl`'s own
Coordinator, TaskQueue and ExperienceBuffer on the simulated clock), rollout instances (worker
loop + continuous-batching engine), verification and Spot interruptions, driven by a rates file
(`rates.PlanConfig`, TOML) that `calibrate` writes from a finished run's measurements or a person
writes from published figures. `sweep` searches trainer:rollout splits (and sandbox density, Spot
fraction) for a budget or a target throughput; `validate` compares predictions with real runs on
this machine.

Pure Python + numpy + pydantic: importing this package (or running a simulation) never imports
torch (tests/unit/test_plan_sim.py checks it in a fresh interpreter).
"""

from slipstream.plan.rates import PlanConfig, dump_toml, load_rates, with_overrides
from slipstream.plan.results import SimResult
from slipstream.plan.sim import Simulator


def simulate(plan: PlanConfig) -> SimResult:
    """Run one simulation of `plan`."""
    return Simulator(plan).run()


__all__ = [
    "PlanConfig",
    "SimResult",
    "Simulator",
    "dump_toml",
    "load_rates",
    "simulate",
    "with_overrides",
]
