"""Sandboxes for untrusted rollout code: backends (process, bwrap, qemu, firecracker), the guest
agent they all run, the warm pool, pinning, crash-safe cleanup, and the node's host agent that
leases one pool to every worker on the node (host_agent.py; client: agent_pool.py). See
docs/sandbox.md.

    from slipstream.sandbox import SandboxTemplate, open_pool
    async with open_pool(SandboxTemplate(backend="bwrap")) as pool:   # a Pool (pool.py)
        async with pool.sandbox() as sb:
            result = await sb.exec(["python3", "-c", "print(1)"], timeout_s=5)
"""

from slipstream.sandbox.agent_pool import AgentPool, LeasedSandbox, make_pool, open_pool
from slipstream.sandbox.base import (
    AgentSandbox,
    Backend,
    ExecResult,
    Sandbox,
    SandboxTemplate,
    backend_class,
    make_backend,
)
from slipstream.sandbox.errors import (
    AdmissionTimeout,
    AgentUnavailable,
    BackendUnavailable,
    LeaseExpired,
    NoCapacity,
    SandboxBroken,
    SandboxError,
)
from slipstream.sandbox.journal import SandboxRecord
from slipstream.sandbox.pool import Pool, PoolOptions, PoolStats, SandboxPool

__all__ = [
    "AdmissionTimeout",
    "AgentPool",
    "AgentSandbox",
    "AgentUnavailable",
    "Backend",
    "BackendUnavailable",
    "ExecResult",
    "LeaseExpired",
    "LeasedSandbox",
    "NoCapacity",
    "Pool",
    "PoolOptions",
    "PoolStats",
    "Sandbox",
    "SandboxBroken",
    "SandboxError",
    "SandboxPool",
    "SandboxRecord",
    "SandboxTemplate",
    "backend_class",
    "make_backend",
    "make_pool",
    "open_pool",
]
