#!/usr/bin/env bash
# Create .venv with rlkit and its CPU dependencies. Idempotent: re-running only checks (the pip steps
# run again only when pyproject.toml or this script changed since they last succeeded).
# torch is installed first, as its CPU build, so no dependency pulls a CUDA wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
STAMP=.venv/.rlkit-setup  # what the last complete install was made from
WANTED=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
# rlkit's modules as bytecode, as pip leaves an installed package's: an editable install's are
# compiled by each process that imports them, and every one compiles them again where
# PYTHONDONTWRITEBYTECODE is set (0.3-0.5 s of CPU per worker process). Stale ones are redone.
compile_rlkit() { .venv/bin/python -m compileall -q rlkit >/dev/null; }
# a command's output only if it fails (apt-get's notes, e.g. debconf's "delaying package configuration")
quietly() {
  local log
  log=$(mktemp)
  "$@" >"$log" 2>&1 || { cat "$log" >&2; rm -f "$log"; return 1; }
  rm -f "$log"
}
if [ -x .venv/bin/rlkit ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$WANTED" ] && command -v bwrap >/dev/null; then
  compile_rlkit
  exit 0
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# PyPI's Linux torch is the CUDA build (gigabytes of dependencies) and PyPI holds no "+cpu" release:
# the first form finds a CPU wheel a local wheel folder or mirror offers (offline machines), the
# second takes it from PyTorch's own CPU index
.venv/bin/python -m pip install -q torch==2.13.0+cpu 2>/dev/null \
  || .venv/bin/python -m pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
.venv/bin/python -m pip install -q -e '.[test]'
# NVIDIA Megatron-Bridge (policy.bridge=megatron_bridge) without its declared dependencies: they pin
# transformers<5 and hydra-core<=1.3.2 and pull CUDA builds (transformer-engine, mamba-ssm). What it
# imports beyond rlkit's own dependencies: triton (megatron-core's modules on its import path import
# it unguarded) and rich (its progress bars). scripts/gpu-wheels.txt carries the same pins to the GPU
# machine, whose torch brings its own triton.
.venv/bin/python -m pip install -q --no-deps megatron-bridge==0.3.1 triton==3.6.0 rich==15.0.0
# bubblewrap is the code sandbox's isolation (rlkit/envs/sandbox.py); code rewards refuse to run without it
if ! command -v bwrap >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    # the first try fails where the package lists are stale; a failure after updating them is shown
    apt-get install -y -q bubblewrap >/dev/null 2>&1 || { quietly apt-get update -q && quietly apt-get install -y -q bubblewrap; }
  else
    echo "setup: install bubblewrap (e.g. sudo apt-get install bubblewrap) for code rewards" >&2
  fi
fi
compile_rlkit
echo "$WANTED" > "$STAMP"
