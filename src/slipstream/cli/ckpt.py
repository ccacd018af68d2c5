"""`slipstream ckpt list|export`: inspect the weight versions and trainer checkpoints of a run's
store, and export a published weight version as an HF-format directory.

`list` reads and verifies every entry (manifest, sizes, hashes, formats, finite weights) and
prints JSON with each one's validity and, when invalid, why; invalid entries are also named on
stderr. A resumed run skips invalid checkpoints (storage/checkpoints.py `latest_valid`)."""

from __future__ import annotations

import argparse
import json
import sys

from slipstream.cli import add_config_args
from slipstream.config import load_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ckpt", help="list weight versions / checkpoints in the store, export weights"
    )
    csub = p.add_subparsers(dest="ckpt_command", metavar="ACTION", required=True)
    ls = csub.add_parser(
        "list", help="published weight versions and checkpoints, each verified (valid or why not)"
    )
    add_config_args(ls)
    ls.set_defaults(func=cmd_list)
    ex = csub.add_parser(
        "export",
        help="copy a weight version into a local HF-format directory with the run's tokenizer "
        "(loadable by `slipstream eval --checkpoint DIR`, `slipstream serve --model DIR`)",
    )
    add_config_args(ex)
    ex.add_argument("--version", type=int, default=None, help="default: the latest")
    ex.add_argument("output", help="directory to write")
    ex.set_defaults(func=cmd_export)


class NoStore(Exception):
    """The store the config names is a local directory that does not exist."""


def _stores(args: argparse.Namespace):
    """The run's stores, read-only: a local store directory that does not exist is NoStore
    (opening it would create it, and a typo in --run.output_dir would leave a run tree)."""
    from pathlib import Path

    from slipstream.storage import open_stores

    cfg = load_config(args.config, args.overrides)
    url = cfg.store.url
    local = url.removeprefix("file://") if "://" not in url or url.startswith("file://") else None
    if local is not None and not Path(local).is_dir():
        raise NoStore(f"slipstream ckpt: no store at {local} (no run wrote there: check "
                      "--run.output_dir / store.url)")  # fmt: skip
    stores = open_stores(cfg)
    return cfg, stores.weights, stores.checkpoints


def cmd_list(args: argparse.Namespace) -> int:
    try:
        _, weights, ckpts = _stores(args)
    except NoStore as e:
        print(e, file=sys.stderr)
        return 1
    versions, checkpoints = weights.status(), ckpts.status()
    print(json.dumps({"store": weights.blob.url,
                      "weight_versions": [v["version"] for v in versions],
                      "checkpoint_steps": [c["step"] for c in checkpoints],
                      "weights": versions, "checkpoints": checkpoints}, indent=1))  # fmt: skip
    for v in versions:
        if not v["valid"]:
            print(f"slipstream ckpt: weight version {v['version']} is invalid: {v['reason']}",
                  file=sys.stderr)  # fmt: skip
    for c in checkpoints:
        if not c["valid"]:
            print(f"slipstream ckpt: checkpoint step {c['step']} is invalid (a resume skips it): "
                  f"{c['reason']}", file=sys.stderr)  # fmt: skip
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    try:
        cfg, weights, _ = _stores(args)
    except NoStore as e:
        print(e, file=sys.stderr)
        return 1
    version = args.version if args.version is not None else weights.latest()
    if version is None:
        print(f"slipstream ckpt: no published weights in {weights.blob.url}")
        return 1
    out = weights.fetch_to_dir(version, args.output)
    # The store holds weights only; the run encoded prompts with [task]'s tokenizer, so the export
    # carries that one and loads anywhere a checkpoint does.
    from slipstream.tasks import get_taskset

    get_taskset(cfg.task).tokenizer.save(out)
    print(out)
    return 0
