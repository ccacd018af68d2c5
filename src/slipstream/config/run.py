"""`[run]`: where outputs go, seeds, device and precision for the whole job."""

from typing import Literal

from pydantic import Field, field_validator

from slipstream.config.base import Section


class RunConfig(Section):
    output_dir: str = "runs/quickstart"
    """Directory for checkpoints, metrics (JSON lines) and reports. Created when missing."""
    seed: int = Field(default=0, ge=0)
    """Global seed: task generation, model init, sampling."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Torch device. `auto` picks CUDA when available, else CPU."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter/compute dtype for the policy model."""
    num_threads: int = Field(default=0, ge=0, le=4096)  # a C int in torch; no host has more
    """torch intra-op threads; 0 leaves torch's default."""
    launcher: Literal["local", "ray", "torchx"] = "local"
    """Where rollout workers run: `local` = processes on this machine (launch/local.py); `ray` =
    Ray actors (launch/ray.py, needs the `ray` extra); `torchx` = a role of their own that a
    scheduler placed, trainer ranks started by torchrun (launch/scheduled.py; set by the TorchX
    component src/slipstream/launch/torchx.py:rl)."""
    ray_address: str = ""
    """With `launcher = "ray"`: empty starts a private local Ray instance for this job; `auto`
    joins the existing cluster this machine belongs to; `host:port` joins that cluster."""
    ray_trainer_resources: dict[str, float] = Field(default_factory=lambda: {"CPU": 1.0})
    """With `launcher = "ray"` and trainer.num_processes > 1: what each trainer rank but rank 0
    (the driver) reserves, as one bundle of a placement group that packs them onto as few nodes
    as possible (e.g. {"GPU": 1, "slipstream_trainer": 1} on a cluster whose trainer nodes
    advertise that custom resource; deploy/kuberay/rayjob-moe.yaml)."""
    metrics_port: int = Field(default=0, ge=0, le=65535)
    """Serve Prometheus `/metrics` of the RL job on this port (observe/prometheus.py: samples/s,
    trainer idle, staleness, queue depth and backlog age, lease expiries, per-worker reports);
    0 = off. Needs prometheus-client (the `serve` extra)."""
    metrics_host: str = "127.0.0.1"
    """Address `/metrics` binds (unauthenticated: `0.0.0.0` only on a private network, e.g. a
    pod scraped by Prometheus)."""

    @field_validator("ray_trainer_resources")
    @classmethod
    def _positive_resources(cls, v: dict[str, float]) -> dict[str, float]:
        bad = {k: x for k, x in v.items() if not k or not x > 0}
        if not v or bad:
            raise ValueError(f"needs resource names with amounts > 0, got {v}")
        return v
