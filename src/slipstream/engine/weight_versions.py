"""SGLang's free-form `weight_version` strings over slipstream's integer policy versions.

slipstream tags every sampled token with an integer version (the trainer's step: what
`output_token_versions`, the RL buffer and the staleness rules use). SGLang's servers carry a
free-form string instead (`--weight-version`, `/update_weights_from_disk {weight_version}`,
`/update_weight_version {new_version}`, `meta_info.weight_version`). Both are kept: a version
string made of decimal digits *is* the integer version (bounded and monotonic, `guard.parse_version`);
any other string is a label, and the update that carries it gets the next integer version
(current + 1), so labels never cost the integer timeline. `label(v)` is what the server reports
for integer version v: its label when one was given, else str(v).

Labels are bounded (`MAX_LABEL_CHARS`, printable, not blank) and the table keeps the newest
`MAX_LABELS` entries (a version older than that reports its integer).
"""

from __future__ import annotations

import re
from collections import OrderedDict

from slipstream.engine.guard import ServeOptions, parse_version

MAX_LABEL_CHARS = 256
MAX_LABELS = 4096
_DIGITS = re.compile(r"[0-9]+")


class WeightVersions:
    """Labels of integer versions (see the module docstring)."""

    def __init__(self) -> None:
        self._labels: OrderedDict[int, str] = OrderedDict()

    def label(self, version: int) -> str:
        return self._labels.get(version, str(version))

    def resolve(
        self, raw: str | None, current: int, options: ServeOptions
    ) -> tuple[int, str | None]:
        """(integer version, label or None) of an update asking for `raw` while `current` is
        served. ValueError naming `weight_version` for a bad one."""
        if raw is None or _DIGITS.fullmatch(raw.strip()):
            return parse_version(raw, current, options), None
        return parse_version(None, current, options), check_label("weight_version", raw)

    def set(self, version: int, label: str | None) -> None:
        """Record `version`'s label (None: it reports its integer)."""
        self._labels.pop(version, None)
        if label is not None and label != str(version):
            self._labels[version] = label
            while len(self._labels) > MAX_LABELS:
                self._labels.popitem(last=False)


def check_label(name: str, raw: str) -> str:
    """`raw` stripped; ValueError naming `name` when blank, too long or not printable."""
    text = raw.strip()
    if not text:
        raise ValueError(f"{name} must not be blank")
    if len(text) > MAX_LABEL_CHARS:
        raise ValueError(f"{name} has {len(text)} characters (at most {MAX_LABEL_CHARS})")
    if not text.isprintable():
        raise ValueError(f"{name} {text[:40]!r} has non-printable characters")
    return text
