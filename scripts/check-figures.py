#!/usr/bin/env python3
"""No measured figure is lost when the README is rewritten (issue 49).

    python3 scripts/check-figures.py [--old REV]

Takes README.md as it was at REV (default: the last commit before the rewrite) and checks that
every figure in it (a number with a decimal point, a thousands separator, or three or more
digits; percentages, ratios, seconds, dates) still appears somewhere in README.md,
docs/**/*.md or benchmarks/**/*.md of the work tree. Prints the figures that appear nowhere, with
the old README's line, and exits 1 if there are any."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# README.md as it stood before issue 49 moved its figures to docs/measurements.md.
BEFORE_REWRITE = "208dad5"
FIGURE = re.compile(r"(?<![\w.])[+-]?\d[\d,]*(?:\.\d+)?(?![\w])")


def figures(text: str) -> dict[str, str]:
    """Each significant number in `text` -> the first line it appears on."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        for m in FIGURE.finditer(line):
            tok = m.group(0).lstrip("+-").rstrip(",")
            if "." in tok or "," in tok or len(tok) >= 3:
                out.setdefault(tok, line.strip())
    return out


def corpus() -> str:
    paths = [ROOT / "README.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("benchmarks/**/*.md")]
    return "\n".join(p.read_text(errors="replace") for p in paths if p.is_file())


def missing(old_readme: str, now: str) -> dict[str, str]:
    have = set(figures(now))
    return {tok: line for tok, line in figures(old_readme).items() if tok not in have}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", default=BEFORE_REWRITE, help="the revision whose README.md is checked")
    args = ap.parse_args()
    old = subprocess.run(["git", "-C", str(ROOT), "show", f"{args.old}:README.md"],
                         check=True, capture_output=True, text=True).stdout  # fmt: skip
    lost = missing(old, corpus())
    for tok, line in sorted(lost.items()):
        print(f"lost: {tok}   in: {line[:140]}")
    n = len(figures(old))
    print(f"check-figures: {n - len(lost)} of {n} figures of README.md@{args.old} are kept")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
