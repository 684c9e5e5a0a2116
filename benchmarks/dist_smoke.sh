#!/usr/bin/env bash
# Distributed smoke on a 2-GPU machine: install, CUDA tests, then verify/capture with 2 ranks.
# Usage (repo root): bash benchmarks/dist_smoke.sh OUTDIR
set -uo pipefail
out=${1:-/tmp/dist_out}; mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1 MOEGRAPH_COLLECTIVE_TIMEOUT_S=120
run() { local name=$1; shift; echo "== $name: $*"; timeout "${T:-300}" "$@" > "$out/$name.json" 2> "$out/$name.err"; echo "rc=$?"; tail -3 "$out/$name.err"; }
run verify_tiny moegraph verify --nproc 2 --ep 2 --steps 4 --json
run capture_tiny moegraph capture --nproc 2 --ep 2 --json
