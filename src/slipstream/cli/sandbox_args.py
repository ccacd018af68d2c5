"""Helpers the sandbox CLI modules share (cli/sandbox.py, cli/sandbox_agent.py): the template
from `[sandbox]` plus options, and the one-line failure exit."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def sandbox_template(args: argparse.Namespace, **over: Any):  # type: ignore[no-untyped-def]
    from slipstream.config import ConfigError, load_config
    from slipstream.sandbox.base import SandboxTemplate

    cfg = load_config(args.config, args.overrides).sandbox
    try:
        tmpl = SandboxTemplate.from_config(cfg, **{k: v for k, v in over.items() if v is not None})
    except ValueError as e:  # the template's own checks name the field and the value
        raise ConfigError(f"invalid sandbox settings: {e}") from None
    return cfg, tmpl


def sandbox_failure(e: Exception) -> int:
    """One line for a backend that cannot run here or a sandbox that broke; exit 1."""
    print(f"slipstream sandbox: {e}", file=sys.stderr)
    return 1
