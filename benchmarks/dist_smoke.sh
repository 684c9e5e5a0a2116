#!/usr/bin/env bash
# Distributed runs on a 2-GPU machine, each command's JSON and stderr kept under OUTDIR.
# Usage (repo root): bash benchmarks/dist_smoke.sh OUTDIR [STAGE...]
#   stages: verify_tiny capture_tiny verify_4l capture_4l single_tiny single_4l
set -uo pipefail
out=${1:-/tmp/dist_out}; shift; mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1 MOEGRAPH_COLLECTIVE_TIMEOUT_S=180
L4=qwen3-30b-a3b-4layer
run() { local name=$1; shift; echo "== $name: $*"; local t0=$SECONDS
  timeout "${T:-400}" "$@" > "$out/$name.json" 2> "$out/$name.err"; echo "rc=$? $((SECONDS - t0))s"
  tail -2 "$out/$name.err"; }
for stage in "$@"; do case $stage in
  verify_tiny) run $stage moegraph verify --nproc 2 --ep 2 --steps 4 --json ;;
  capture_tiny) run $stage moegraph capture --nproc 2 --ep 2 --json ;;
  verify_4l) run $stage moegraph verify --profile $L4 --nproc 2 --ep 2 --steps 3 --json ;;
  capture_4l) run $stage moegraph capture --profile $L4 --nproc 2 --ep 2 --json ;;
  single_tiny) CUDA_VISIBLE_DEVICES=0 run $stage moegraph capture --json ;;
  single_4l) CUDA_VISIBLE_DEVICES=0 run $stage moegraph capture --profile $L4 --json ;;
  *) echo "unknown stage $stage" ;;
esac; done
