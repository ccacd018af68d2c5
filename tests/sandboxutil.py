"""Shared by the tests that run real bwrap sandboxes: why they cannot run here, if they cannot."""

from __future__ import annotations

import os

import pytest

from slipstream.sandbox.cgroups import CgroupManager


def bwrap_unusable() -> str | None:
    """The reason the bwrap backend cannot run on this host, or None."""
    if os.geteuid() != 0:
        return "the bwrap backend needs root (per-sandbox cgroups, setuid to nobody)"
    if not os.access("/usr/bin/bwrap", os.X_OK):
        return "/usr/bin/bwrap is not installed (scripts/setup.sh installs bubblewrap)"
    try:
        CgroupManager.detect("/sys/fs/cgroup")
    except OSError as e:
        return f"cgroups are not writable here: {e}"
    return None


_REASON = bwrap_unusable()  # probed once per test process
needs_bwrap = pytest.mark.skipif(_REASON is not None, reason=str(_REASON))
