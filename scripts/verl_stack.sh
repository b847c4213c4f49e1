#!/usr/bin/env bash
# verl 0.9.1's stack (scripts/verl-wheels.txt) for benchmarks/e2e_verl.py, carried beside rlkit's with the
# wheel-staging kit's scripts (GPUCARRY_KIT: its folder) unchanged: staged into .gpucarry-verl/c1..cN (never .gpucarry, which holds
# rlkit's set) and installed on the GPU machine into /tmp/site-verl (rlkit's: /tmp/site).
#   bash scripts/verl_stack.sh stage                 CPU machine: writes .gpucarry-verl/c* and CALLS.txt
#   bash scripts/verl_stack.sh install [--need-all]  GPU machine, once per part, back to back (.gpucarry-verl/CALLS.txt)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
KIT=${GPUCARRY_KIT:-}  # needed by stage only
CARRY=.gpucarry-verl
SITE=/tmp/site-verl

stage() {
  cd "$ROOT"
  git check-ignore -q "$CARRY/probe" || { echo "verl_stack: $CARRY/ is not git-ignored; it would travel with every call" >&2; exit 1; }
  # the kit's stage.sh writes REPO/.gpucarry and works in $TMPDIR: give it a scratch checkout and folder
  tmp=$(mktemp -d "${TMPDIR:-/tmp}/verl-stage.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  git init -q "$tmp/repo"
  # each part travels with this checkout's working tree (64 MiB a call): size the parts by it, as stage.sh would
  local tree; tree=$(git ls-files -z -co --exclude-standard | python3 -c '
import os, sys
print(-(-sum(os.path.getsize(p) for p in sys.stdin.read().split("\0") if p and os.path.isfile(p)) // 1048576))')
  local chunk=$(( 63 - tree < 60 ? 63 - tree : 60 ))
  # stage.sh ends with `du .gpucarry/smoke`, which fails under SMOKE=0 after everything is written: its
  # CALLS.txt, written last but that, tells a finished staging
  [ -n "$KIT" ] || { echo "verl_stack.sh stage: set GPUCARRY_KIT to the wheel-staging kit (docs/gpu.md)" >&2; exit 2; }
  TMPDIR=$tmp EXTRA_WHEELS=$ROOT/scripts/verl-wheels.txt SMOKE=0 CHUNK_MIB=$chunk bash "$KIT/stage.sh" "$tmp/repo" \
    | grep -v "^with \|^# then\|^# Send\|^# each\|^WARNING: Location" || true
  [ -f "$tmp/repo/.gpucarry/CALLS.txt" ] || { echo "verl_stack: the kit's stage.sh failed (above)" >&2; exit 1; }
  rm -rf "$CARRY"; mkdir -p "$CARRY"
  mv "$tmp"/repo/.gpucarry/c* "$CARRY/"
  local parts; parts=$(ls -d "$CARRY"/c* | wc -l)
  {
    echo "# verl 0.9.1 set $(awk '$1=="set"{print $2}' "$CARRY/c1/manifest.txt"): $parts parts of <= $chunk MiB for $SITE"
    echo "# After rlkit's set (.gpucarry/CALLS.txt, its last call without tests), back to back (< 30 s apart),"
    echo "# each with the named folder carried:"
    for i in $(seq 1 "$parts"); do
      if [ "$i" -lt "$parts" ]; then echo "with $CARRY/c$i:  bash scripts/verl_stack.sh install"
      else echo "with $CARRY/c$i:  bash scripts/verl_stack.sh install --need-all && bash scripts/gpu_session.sh e2e-verl"; fi
    done
  } >"$CARRY/CALLS.txt"
  du -sh "$CARRY"/c* | sed 's/^/verl_stack: /'
  echo "verl_stack: working tree that travels with each call: ${tree} MiB"
  cat "$CARRY/CALLS.txt"
}

install() {
  cd "$ROOT"
  local boot; boot=$(ls "$CARRY"/c*/bootstrap.sh 2>/dev/null | head -1)
  [ -n "$boot" ] || { echo "verl_stack: no $CARRY/cK folder came with this call" >&2; exit 2; }
  # the kit's bootstrap.sh, pointed at verl's own stash and install directory
  GPUCARRY_SITE=$SITE GPUCARRY_STASH=/tmp/gpucarry-verl bash "$boot" "$@"
}

case "${1:-}" in
  stage) stage ;;
  install) install "${@:2}" ;;
  *) echo "usage: bash scripts/verl_stack.sh stage | install [--need-all] [--check]" >&2; exit 2 ;;
esac
