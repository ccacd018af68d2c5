"""`slipstream config show|schema`: print the resolved config or the documented schema."""

from __future__ import annotations

import argparse
import json
import math
import re
from typing import Any

from pydantic import BaseModel

from slipstream.cli import add_config_args
from slipstream.config import SlipstreamConfig, load_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="show the resolved config or the documented schema")
    csub = p.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    show = csub.add_parser(
        "show", help="print the fully resolved config (file + overrides + defaults)"
    )
    add_config_args(show)
    show.add_argument("--json", action="store_true", help="print JSON instead of TOML")
    show.set_defaults(func=cmd_show)
    schema = csub.add_parser("schema", help="list every key with type, default and meaning")
    schema.set_defaults(func=cmd_schema)


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_key(k: str) -> str:
    return k if _BARE_KEY.match(k) else json.dumps(k)


def _toml_value(v: Any) -> str:
    """`v` (JSON-mode data: str, bool, int, float, list, dict) as a TOML value, so the printed
    config loads back as it is (`slipstream run -c` of it resolves to the same config)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, int | str):
        return json.dumps(v)  # a JSON string is a TOML basic string (same escapes)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"no TOML form for {type(v).__name__}: {v!r}")


def cmd_show(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    data = cfg.model_dump(mode="json")
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    for section, values in data.items():
        print(f"[{section}]")
        for k, v in values.items():
            # TOML has no null: an unset key is left out (its default, None, is what loads).
            print(f"# {k}: unset" if v is None else f"{_toml_key(k)} = {_toml_value(v)}")
        print()
    return 0


def _walk_schema(model: type[BaseModel], prefix: str) -> list[tuple[str, str, str, str]]:
    rows = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows.extend(_walk_schema(ann, f"{prefix}{name}."))
            continue
        default = field.get_default(call_default_factory=True)
        rows.append(
            (
                f"{prefix}{name}",
                getattr(ann, "__name__", str(ann)),
                repr(default),
                field.description or "",
            )
        )
    return rows


def cmd_schema(args: argparse.Namespace) -> int:
    for key, typ, default, doc in _walk_schema(SlipstreamConfig, ""):
        print(f"{key}  ({typ}, default {default})\n    {doc}")
    return 0
