"""Errors of the sandbox layer."""

from __future__ import annotations


class SandboxError(RuntimeError):
    """A sandbox operation failed; the message names the sandbox and the operation."""


class SandboxBroken(SandboxError):
    """The sandbox can no longer be used (agent died, channel closed, agent hung). Destroy it."""


class BackendUnavailable(SandboxError):
    """A backend cannot run on this host; the message says why (see `slipstream sandbox doctor`)."""


class AdmissionTimeout(SandboxError):
    """`SandboxPool.acquire` waited longer than its timeout for admission."""
