#!/usr/bin/env bash
# rlkit's GPU work on a device machine prepared by ../shared/gpu (README "GPU development").
#   bash scripts/gpu_session.sh tests|bench|bench-7b      logs and JSON land in $OUT
set -uo pipefail
source /tmp/gpucarry/env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled
OUT=${OUT:-/tmp/rlkit_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
case "$1" in
  tests)
    timeout 560 python3 -m pytest tests/gpu -v -rA -s -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" ;;
  bench)
    timeout 250 python3 benchmarks/generation.py --size 1.5b --out "$OUT/generation.json" 2>&1 | tee "$OUT/generation.log"
    timeout 320 python3 benchmarks/refit.py --sizes 1.5b --out "$OUT/refit_1.5b.json" 2>&1 | tee "$OUT/refit_1.5b.log" ;;
  bench-7b)
    timeout 570 python3 benchmarks/refit.py --sizes 7b --out "$OUT/refit_7b.json" 2>&1 | tee "$OUT/refit_7b.log" ;;
esac
