#!/usr/bin/env bash
# Sets up everything slipstream needs on a fresh Debian machine (Python 3.11, root for apt-get).
#   scripts/setup.sh            core + extras for running (serve, hf)
#   scripts/setup.sh --dev      also test tools (pytest, moto, ray, ...) and the Debian packages the tests use
# Idempotent: the venv is reused, and pip runs again only when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
DEV=0
[[ "${1:-}" == "--dev" ]] && DEV=1

# Debian packages: bubblewrap and util-linux (bwrap sandboxes; setpriv and taskset start them);
# QEMU, busybox, cpio, kmod (depmod) and lz4 (guest image and kernel extraction for microVM
# sandboxes; the cloud kernel itself is fetched into the image cache with `apt-get download`, never
# installed on the host); python3 (Debian's interpreter runs inside bwrap sandboxes and the guest
# image). Installed only when missing; without root we say what is missing and go on.
APT_PKGS=(bubblewrap util-linux qemu-system-x86 busybox-static cpio lz4 kmod python3)
missing=()
for p in "${APT_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    echo "setup: apt-get install ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "setup: WARNING missing Debian packages (need root to install): ${missing[*]}" >&2
  fi
fi

PY=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  echo "setup: creating .venv"
  "$PY" -m venv .venv
fi
EXTRAS="serve,hf,data"
((DEV)) && EXTRAS="serve,hf,data,s3,ray,dev"
stamp=".venv/.slipstream-installed-$EXTRAS"
if [[ ! -f "$stamp" || pyproject.toml -nt "$stamp" ]]; then
  .venv/bin/pip install -q --upgrade pip
  # torch first, pinned: pip takes the CPU build that lies on disk on the dev machines. A GPU user
  # installs a CUDA build before this script (see README); the pin below is then already satisfied.
  .venv/bin/python -W ignore -c "import torch" 2>/dev/null || .venv/bin/pip install -q "torch==2.13.0"
  # Keep that torch (or the user's CUDA build): unpinned, pip's resolver replaced 2.13.0+cpu with
  # the 2.14.1 CUDA wheel and its nvidia-* packages while installing the extras (seen in CI).
  .venv/bin/python -W ignore -c "import torch; print('torch==' + torch.__version__)" > .venv/torch-pin.txt
  .venv/bin/pip install -q -e ".[$EXTRAS]" -c .venv/torch-pin.txt
  touch "$stamp"
fi
