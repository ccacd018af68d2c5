#!/usr/bin/env bash
# Fills the wheelhouse scripts/gpu-check.sh installs from on the GPU device machine, which has no
# network: wheels for CPython 3.12 on manylinux x86_64 of every runtime dependency the project
# declares (pyproject.toml: core dependencies + the `serve` extra) that the device's Python does
# not already provide, with their dependencies, resolved together by `pip download`.
#
#   bash scripts/gpu-wheels.sh            # (re)build .wheelhouse/ (needs PyPI), then verify it
#   bash scripts/gpu-wheels.sh --verify   # only verify an existing .wheelhouse/ (no network)
#
# Contract (checked by --verify, and after every build): one version per project; every wheel
# installs on CPython 3.12 / manylinux x86_64 (tags cp312, abi3 or none; py3 pure wheels); every
# requested project is present; at most $SLIPSTREAM_WHEELHOUSE_MAX_MIB MiB in all (default 48:
# the device takes at most 64 MiB with the working tree). The build goes to a fresh directory
# that replaces the old one, so no stale second version survives. .wheelhouse/ is git-ignored;
# carry it to the device (`carry: [".wheelhouse"]`).
#
# DEVICE_PROVIDES lists what the device image already has (/work/.library/device/KINDS.md,
# nvidia-h200: torch 2.11 CUDA, numpy, safetensors, rich, fsspec, httpx, matplotlib,
# transformers, tokenizers, pytest, pytest-timeout); those are not downloaded. Everything else
# the project needs at runtime (pydantic, fastapi, uvicorn, ...) is. requirements.txt in the
# wheelhouse lists the resolved name==version set.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELHOUSE=${SLIPSTREAM_WHEELHOUSE:-.wheelhouse}
MAX_MIB=${SLIPSTREAM_WHEELHOUSE_MAX_MIB:-48}
PY=${PYTHON:-.venv/bin/python}
[[ -x $PY ]] || PY=python3
DEVICE_PROVIDES="torch safetensors numpy rich fsspec httpx matplotlib transformers tokenizers"
# CPython 3.12 on x86_64 glibc: pip matches manylinux_2_N exactly, so name the common N
PLATFORM_ARGS=(--only-binary=:all: --implementation cp --python-version 3.12
  --abi cp312 --abi abi3 --abi none
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
  --platform manylinux_2_24_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64
  --platform manylinux_2_34_x86_64 --platform manylinux1_x86_64)

die() { echo "gpu-wheels: $*" >&2; exit 1; }

# The requirement specs to download: pyproject's runtime dependencies minus DEVICE_PROVIDES.
requirements() {
  DEVICE_PROVIDES=$DEVICE_PROVIDES "$PY" - <<'EOF'
import os, re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
specs = project["dependencies"] + project["optional-dependencies"]["serve"]
provided = set(os.environ["DEVICE_PROVIDES"].split())
for spec in specs:
    name = re.match(r"[A-Za-z0-9._-]+", spec).group(0).lower().replace("_", "-")
    if name not in provided:
        print(spec)
EOF
}

verify() {
  [[ -d $WHEELHOUSE ]] \
    || die "no $WHEELHOUSE/: run bash scripts/gpu-wheels.sh where PyPI is reachable"
  local reqs
  reqs=$(requirements)
  REQS=$reqs MAX_MIB=$MAX_MIB "$PY" - "$WHEELHOUSE" <<'EOF'
import os, re, sys
from pathlib import Path
house = Path(sys.argv[1])
wheels = sorted(house.glob("*.whl"))
errors = []
if not wheels:
    errors.append(f"{house} holds no wheels")
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
seen, total = {}, 0
for w in wheels:
    parts = w.name[:-4].split("-")
    if len(parts) not in (5, 6):
        errors.append(f"{w.name}: not a wheel file name")
        continue
    name, version, (py, abi, plat) = norm(parts[0]), parts[1], parts[-3:]
    seen.setdefault(name, []).append(version)
    total += w.stat().st_size
    py_ok = any(t in ("py3", "cp312") for t in py.split("."))
    abi_ok = any(t in ("none", "abi3", "cp312") for t in abi.split("."))
    plat_ok = all(t == "any" or (t.startswith("manylinux") and t.endswith("_x86_64"))
                  for t in plat.split("."))
    if not (py_ok and abi_ok and plat_ok):
        errors.append(f"{w.name}: tags {py}-{abi}-{plat} do not install on CPython 3.12 "
                      "manylinux x86_64")
for name, versions in seen.items():
    if len(versions) > 1:
        errors.append(f"{name}: {len(versions)} versions {versions} (pip refuses two)")
for spec in os.environ["REQS"].split("\n"):
    if spec and norm(re.match(r"[A-Za-z0-9._-]+", spec).group(0)) not in seen:
        errors.append(f"requested {spec!r} has no wheel")
limit = float(os.environ["MAX_MIB"]) * 2**20
if total > limit:
    errors.append(f"{total / 2**20:.1f} MiB > limit {limit / 2**20:.0f} MiB")
for w in wheels:
    print(f"  {w.stat().st_size / 2**20:7.2f} MiB  {w.name}")
print(f"  {total / 2**20:7.2f} MiB  total in {len(wheels)} wheels ({house}, "
      f"limit {limit / 2**20:.0f} MiB)")
if errors:
    sys.exit("gpu-wheels: wheelhouse check failed:\n  " + "\n  ".join(errors))
print("gpu-wheels: wheelhouse ok for CPython 3.12 manylinux x86_64")
EOF
}

build() {
  local reqs tmp
  reqs=$(requirements)
  [[ -n $reqs ]] || die "nothing to download: every runtime dependency is in DEVICE_PROVIDES"
  echo "gpu-wheels: downloading for CPython 3.12 manylinux x86_64:" $reqs
  tmp=$(mktemp -d "${WHEELHOUSE%/}.tmp.XXXXXX")
  # shellcheck disable=SC2086  # one spec per word
  if ! "$PY" -m pip download -q --disable-pip-version-check --dest "$tmp" "${PLATFORM_ARGS[@]}" \
      $reqs; then
    rm -rf "$tmp"
    die "pip download failed (is PyPI reachable? pip's own message is above)"
  fi
  (cd "$tmp" && for w in *.whl; do
     n=${w%%-*}; v=${w#*-}; echo "$n==${v%%-*}"; done) | sort > "$tmp/requirements.txt"
  rm -rf "$WHEELHOUSE"
  mv "$tmp" "$WHEELHOUSE"
}

case "${1:-}" in
  --verify) verify ;;
  "") build; verify ;;
  *) die "usage: bash scripts/gpu-wheels.sh [--verify]" ;;
esac
