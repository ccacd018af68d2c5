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


class NoCapacity(AdmissionTimeout):
    """The host agent has no capacity for another sandbox (its admission limit is reached, or the
    bounded wait the caller asked for passed). An infrastructure failure: the caller's candidate
    did nothing wrong; retry later or elsewhere."""


class AgentUnavailable(SandboxBroken):
    """The node's host agent cannot be reached (no socket, refused, permission denied), refused
    this client (template or protocol mismatch, uid not allowed), is draining, or its connection
    was lost (a sandbox leased through it is then gone). An infrastructure failure."""


class LeaseExpired(SandboxBroken):
    """The lease was not renewed within the host agent's lease TTL (the client was frozen or too
    slow to send its heartbeat); the agent destroyed the sandbox."""
