#!/usr/bin/env bash
# Create .venv with rlkit and its CPU dependencies. Idempotent: re-running only checks.
# torch is installed first from the pinned CPU build so no dependency pulls a CUDA wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[test]'
