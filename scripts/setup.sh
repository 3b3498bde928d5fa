#!/usr/bin/env bash
# Create ./.venv and install fxport into it. Sourced by demo.sh and test.sh.
# Usage: source scripts/setup.sh [dev|worker]
set -euo pipefail
extra="${1:-dev}"
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
stamp=".venv/.fxport-installed-$extra"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  python -m pip install -q --upgrade pip
  # torch is pinned to the CPU build of 2.13.0 in pyproject.toml; a looser pin pulls CUDA.
  python -m pip install -q -e ".[$extra]"
  touch "$stamp"
fi
