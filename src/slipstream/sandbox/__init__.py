"""Sandboxes for untrusted rollout code: backends (process, bwrap, qemu, firecracker), the guest
agent they all run, the host agent's warm pool, pinning, and crash-safe cleanup. See docs/sandbox.md.

    from slipstream.sandbox import SandboxPool, SandboxTemplate
    async with SandboxPool(SandboxTemplate(backend="bwrap")) as pool:
        async with pool.sandbox() as sb:
            result = await sb.exec(["python3", "-c", "print(1)"], timeout_s=5)
"""

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
    BackendUnavailable,
    SandboxBroken,
    SandboxError,
)
from slipstream.sandbox.journal import SandboxRecord
from slipstream.sandbox.pool import PoolOptions, PoolStats, SandboxPool

__all__ = [
    "AdmissionTimeout",
    "AgentSandbox",
    "Backend",
    "BackendUnavailable",
    "ExecResult",
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
]
