"""The test tree itself: pytest's default import mode ("prepend", no __init__.py) imports each
test file as a top-level module named after its basename, so two files with one basename in
different folders break collection of the whole suite (CI failed on exactly this once)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_file_basenames_are_unique() -> None:
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        if ".venv" in path.parts or "__pycache__" in path.parts:
            continue
        by_name[path.name].append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not clashes, f"test modules share a basename (rename one): {clashes}"
