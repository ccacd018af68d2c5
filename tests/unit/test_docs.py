"""docs/architecture.md describes the system as built: every module its data-flow diagram and
layer table name exists, and the layers it lists are the ones import-linter enforces."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "slipstream"


def _section(text: str, heading: str) -> str:
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def test_every_module_the_data_flow_names_exists() -> None:
    flow = _section((ROOT / "docs" / "architecture.md").read_text(), "Data flow")
    named = set(re.findall(r"\b([a-z_]+(?:/[a-z_]+)*\.py)\b", flow))
    assert len(named) >= 15, named
    missing = sorted(m for m in named if not (SRC / m).is_file())
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_the_documented_layers_are_the_enforced_ones() -> None:
    layers_doc = _section((ROOT / "docs" / "architecture.md").read_text(), "Layers")
    block = layers_doc.split("```")[1].strip().splitlines()
    documented = [line.split("  ")[0].strip() for line in block]
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c for c in config["contracts"] if c["type"] == "layers"]
    assert documented == layers["layers"]
    for layer in layers["layers"]:
        for name in layer.split(" | "):
            assert (SRC / name).is_dir() or (SRC / f"{name}.py").is_file(), name


def test_every_repository_path_the_readme_names_exists() -> None:
    """README's links and backticked repo paths (docs/, benchmarks/, scripts/, configs/,
    deploy/) point at files that are in the tree, so a moved result does not leave a dead link."""
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(((?:docs|benchmarks|scripts|configs|deploy)/[^)#\s]+)\)", readme)
    ticks = re.findall(r"`((?:docs|benchmarks|scripts|configs|deploy)/[A-Za-z0-9_./-]+)`", readme)
    named = {p.rstrip("/") for p in links + ticks if "<" not in p and "*" not in p}
    assert len(named) >= 10, named
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"README.md names paths that do not exist: {missing}"


def test_the_docs_index_lists_every_page_and_links_only_real_ones() -> None:
    """docs/README.md (issue 49): one line per docs page, so a new page is findable from the
    README in two links; every link in it resolves."""
    index = (ROOT / "docs" / "README.md").read_text()
    links = set(re.findall(r"\]\(([^)#\s]+)\)", index))
    missing = sorted(p for p in links if not (ROOT / "docs" / p).exists())
    assert not missing, f"docs/README.md links paths that do not exist: {missing}"
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").glob("*.md")}
    pages |= {"journal/" + p.name for p in (ROOT / "docs" / "journal").glob("*.md")}
    unlisted = sorted(pages - links - {"README.md"})
    assert not unlisted, f"docs pages the index does not list: {unlisted}"
