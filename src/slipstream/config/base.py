"""Config plumbing: the strict base model, TOML loading, dotted command-line overrides, and errors
that name the key, the value and the file.

Imports without torch (only pydantic and the standard library).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, TypeVar

from annotated_types import Le, Lt
from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator

M = TypeVar("M", bound=BaseModel)

MAX_INT = 2**31 - 1
"""Default ceiling of an integer key without a bound of its own: counts, sizes and steps go into
int32 tensors, cgroup files and C `int` arguments (torch.set_num_threads, sysconf); 1e20 used to
load and then fail late with a traceback."""
MAX_FLOAT = 3.4e38
"""Default ceiling of a float key: the largest float32 (coefficients, rates and temperatures end
up in float32 tensors, where anything larger is inf)."""
MAX_SECONDS = 1e9
"""Default ceiling of a `*_s` key (~31 years): waits take at most threading.TIMEOUT_MAX (~9.2e9 s)
and asyncio timers overflow beyond it."""


def _beyond(value: Any, ceiling: float) -> Any:
    """The first number in `value` (a number, list or dict of them) outside [-ceiling, ceiling]."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return value if abs(value) > ceiling else None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return next((b for v in items if (b := _beyond(v, ceiling)) is not None), None)


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, field docstrings are the docs, and
    no float field (of any section, in lists and dicts too, on load and on assignment) takes NaN
    or +-inf: TOML and the command line can spell them (`--trainer.lr=inf`), and a non-finite
    learning rate, clip or timeout turns into NaN weights or waits that never end. The error
    names the key and the value (`trainer.lr = inf: Input should be a finite number`)."""

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_assignment=True,
        frozen=False,
        allow_inf_nan=False,
    )

    @field_validator("*", mode="after")
    @classmethod
    def _bounded(cls, value: Any, info: ValidationInfo) -> Any:
        """Every numeric key is bounded: by its own `le`/`lt` when it has one (a bound of what
        the code can do, e.g. sandbox.memory_mib), else by MAX_INT, MAX_SECONDS (`*_s` keys) or
        MAX_FLOAT, in either direction. The error names the key (pydantic adds it)."""
        field = cls.model_fields.get(info.field_name or "")
        if value is None or field is None or any(isinstance(m, Le | Lt) for m in field.metadata):
            return value
        name = info.field_name or ""
        ceiling = MAX_SECONDS if name.endswith("_s") else MAX_FLOAT
        limit = MAX_INT if _all_ints(value) else ceiling
        if (bad := _beyond(value, limit)) is not None:
            raise ValueError(f"{_short(repr(bad))} is out of range: at most {limit:,} in magnitude")
        return value


def _all_ints(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    items = (
        value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
    )
    return items is not None and all(_all_ints(v) for v in items) and bool(items)


class ConfigError(ValueError):
    """A config that cannot be used. The message names the key, the value and where it came from."""


def parse_override(item: str) -> tuple[list[str], Any]:
    """`trainer.lr=3e-4` -> (["trainer", "lr"], 0.0003). The value is read as a TOML literal when it
    parses as one (numbers, booleans, quoted strings, arrays), else kept as a bare string."""
    item = item.removeprefix("--")
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form section.key=value")
    key, raw = item.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r} has an empty key")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    except RecursionError:  # `[[[[...` thousands deep: tomllib recurses per level
        raise ConfigError(f"override {_short(item)!r}: the value is nested too deeply") from None
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each dotted override in a nested dict (in place) and return it."""
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
            node = child
        node[path[-1]] = value
    return data


def _lookup(data: Any, loc: tuple[Any, ...]) -> Any:
    for part in loc:
        if isinstance(data, dict) and part in data:
            data = data[part]
        elif isinstance(data, list) and isinstance(part, int) and part < len(data):
            data = data[part]
        else:
            return "<missing>"
    return data


def _short(text: str, limit: int = 80) -> str:
    """A value as an error shows it: a 400-digit or 10,000-character one is cut, not echoed."""
    return text if len(text) <= limit else f"{text[: limit - 20]}...({len(text)} chars)"


def format_validation_error(err: ValidationError, data: dict[str, Any], origin: str) -> str:
    lines = [f"invalid config ({origin}):"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        value = e.get("input", _lookup(data, e["loc"]))
        if e["type"] == "extra_forbidden":
            lines.append(f"  {key} = {_short(repr(value))}: unknown key")
        elif isinstance(value, dict):  # a section's own check: its message names the keys
            lines.append(f"  {key or 'config'}: {e['msg'].removeprefix('Value error, ')}")
        else:
            lines.append(f"  {key} = {_short(repr(value))}: {e['msg']}")
    return "\n".join(lines)


def read_toml(path: str | Path) -> dict[str, Any]:
    """The TOML file at `path`; ConfigError naming it when it is missing, not a regular file,
    unreadable, not UTF-8 or not TOML."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    if not path.is_file():  # a directory, a FIFO (reading one would block), a device
        raise ConfigError(f"config file {path} is not a regular file")
    try:
        return tomllib.loads(path.read_bytes().decode("utf-8"))
    except OSError as e:
        raise ConfigError(f"config file {path}: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e})") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from e
    except RecursionError:  # arrays or inline tables thousands deep: tomllib recurses per level
        raise ConfigError(f"{path}: not usable TOML: nested too deeply") from None


def load_model(
    model_cls: type[M], path: str | Path | None = None, overrides: list[str] | None = None
) -> M:
    """Build `model_cls` from an optional TOML file plus dotted overrides. Fails with ConfigError
    (naming key, value and file/command line) before any work starts."""
    data = read_toml(path) if path is not None else {}
    origin = str(path) if path is not None else "built-in defaults"
    if overrides:
        # repr without its quotes: a newline or U+2028 in a value does not break the line
        origin += " + command-line overrides " + " ".join(_short(repr(o)[1:-1]) for o in overrides)
        apply_overrides(data, overrides)
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, data, origin)) from None
