"""Provenance for benchmark and run records: where, on what, and from which code a figure came.

`collect_provenance()` never raises for a missing fact (no git, no /proc/cpuinfo): the field is
None instead, so a benchmark on an odd machine still writes its JSON. torch is reported only if it
is already importable; this module itself imports only the standard library.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[3]


def _cpu_model() -> str | None:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or None


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args],
            cwd=_REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _torch_facts() -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {"torch": None}
    facts: dict[str, Any] = {
        "torch": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        facts["cuda_device"] = torch.cuda.get_device_name(0)
        facts["cuda_version"] = torch.version.cuda
    return facts


def collect_provenance(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Facts about this host, software and code version, plus `extra` (which wins on key clashes).

    Keys: hostname, cpu_model, nproc, kernel, platform, python, torch (+ torch_num_threads,
    cuda_available, cuda_device, cuda_version), slipstream, git_commit, git_dirty, timestamp_utc
    (ISO 8601). Missing facts are None.
    """
    from slipstream import __version__

    status = _git("status", "--porcelain")
    prov: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "cpu_model": _cpu_model(),
        "nproc": os.cpu_count(),
        "kernel": platform.release(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        **_torch_facts(),
        "slipstream": __version__,
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": None if status is None else bool(status),
        "timestamp_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }
    if extra:
        prov.update(extra)
    return prov


def write_result(path: str | Path, record: dict[str, Any]) -> Path:
    """Write a benchmark's JSON record (with its provenance) to `path`, making the folder."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    return out
