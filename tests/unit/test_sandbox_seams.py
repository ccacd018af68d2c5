"""The sandbox seams stay seams (issue 33): in the sandbox package, the environments, the code
task, the RL verifier, the sandbox CLI and the store lock, no keyword filtering by signature, no
`getattr` probing for an optional attribute, and no import of another module's private names.
Backends, pools and task sets say what they offer through their types (Backend, Pool,
SandboxedTaskSet)."""

from __future__ import annotations

import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "slipstream"
OWNED = ["sandbox", "envs", "tasks/code.py", "rl/verifier.py", "cli/sandbox.py",
         "storage/lock.py", "storage/blob.py", "rundir.py"]  # fmt: skip
FORBIDDEN = {
    "inspect.signature filtering": re.compile(r"inspect\.signature"),
    "getattr probing with a default": re.compile(r"getattr\([^()]+,\s*\"[A-Za-z_]\w*\",\s*[^)]"),
    "callable(getattr(...)) probing": re.compile(r"callable\(getattr\("),
    "sys.modules probing": re.compile(r"getattr\(sys\.modules"),
    "a private name imported from another module": re.compile(
        r"^\s*from slipstream\.[\w.]+ import (?:\(|[^#\n]*\b_[A-Za-z])", re.M
    ),
}


def _files() -> list[Path]:
    out: list[Path] = []
    for rel in OWNED:
        p = SRC / rel
        out.extend(sorted(p.rglob("*.py")) if p.is_dir() else [p])
    return out


def _private_names_in_parenthesised_imports(text: str) -> list[str]:
    found = []
    for m in re.finditer(r"^\s*from slipstream\.[\w.]+ import \(([^)]*)\)", text, re.M):
        found += [n for n in re.findall(r"\b(\w+)\b", m.group(1)) if n.startswith("_")]
    return found


def test_no_probing_or_private_imports_in_the_sandbox_seams():
    files = _files()
    assert len(files) > 20
    bad = []
    for path in files:
        text = path.read_text()
        for what, pattern in FORBIDDEN.items():
            for m in pattern.finditer(text):
                if m.group(0).rstrip().endswith("(") and what.startswith("a private"):
                    continue  # parenthesised: checked name by name below
                line = text.count("\n", 0, m.start()) + 1
                bad.append(f"{path.relative_to(SRC)}:{line}: {what}: {m.group(0).strip()}")
        for name in _private_names_in_parenthesised_imports(text):
            bad.append(f"{path.relative_to(SRC)}: a private name imported: {name}")
    assert bad == []
