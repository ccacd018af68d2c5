"""`[sandbox]`: isolation backend and the host agent's warm pool."""

from typing import Literal

from pydantic import Field

from slipstream.config.base import Section


class SandboxConfig(Section):
    backend: Literal["process", "bwrap", "qemu", "firecracker"] = "bwrap"
    """Isolation backend. `process` is for development only and isolates nothing."""
    vcpus: int = Field(default=1, ge=1)
    """vCPUs per sandbox."""
    memory_mib: int = Field(default=512, ge=16)
    """Memory limit per sandbox."""
    pinning: Literal["none", "core", "thread", "l3"] = "none"
    """CPU pinning policy."""
    max_density: float = Field(default=1.0, gt=0)
    """Admission limit: live sandboxes <= online vCPUs x max_density (the seed's 1.0x rule)."""
