#!/usr/bin/env bash
# Distributed runs on the 2-GPU machine (and the matching 1-GPU runs on its first GPU). Each
# stage's --json document and stderr land in OUTDIR; at the end benchmarks/distributed.py turns
# the documents into OUTDIR/distributed.json and the logs are packed into OUTDIR/logs.tar.gz.
# Usage (repo root): bash benchmarks/run_dist.sh OUTDIR STAGE[:SECONDS]...
set -uo pipefail
out=${1:?OUTDIR}; shift; mkdir -p "$out/runs"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1 MOEGRAPH_COLLECTIVE_TIMEOUT_S=240
L4=qwen3-30b-a3b-4layer
FULL=(--profile qwen3-30b-a3b --set run.batch=1 --set run.seq_len=1024)
D2=(--nproc 2 --ep 2)
run() { local name=$1 limit=$2; shift 2; echo "== $name ($limit s): $*"; local t0=$SECONDS
  timeout "$limit" "$@" > "$out/runs/$name.json" 2> "$out/runs/$name.err"
  echo "rc=$? $((SECONDS - t0))s"; grep -v Warning "$out/runs/$name.err" | tail -2; }
for spec in "$@"; do stage=${spec%%:*}; limit=${spec#*:}; [ "$limit" = "$spec" ] && limit=300
case $stage in
  full_plan) run $stage $limit moegraph plan "${FULL[@]}" "${D2[@]}" --budget 139GiB \
               --out "$out/runs/full_plan.yaml" --json ;;
  full_per_entry) run $stage $limit moegraph capture "${FULL[@]}" "${D2[@]}" --pool per_entry \
               --steps 3 --warmup 1 --json ;;
  full_planned) run $stage $limit moegraph capture "${FULL[@]}" "${D2[@]}" \
               --plan "$out/runs/full_plan.yaml" --steps 5 --warmup 2 --json ;;
  verify_tiny) run $stage $limit moegraph verify "${D2[@]}" --steps 4 --json ;;
  capture_tiny) run $stage $limit moegraph capture "${D2[@]}" --json ;;
  verify_4l) run $stage $limit moegraph verify --profile $L4 "${D2[@]}" --steps 3 --json ;;
  ref_4l) run $stage $limit moegraph verify --profile $L4 "${D2[@]}" --steps 3 --no-lr0 \
               --reference single --tolerance 2e-2 --json ;;
  capture_4l) run $stage $limit moegraph capture --profile $L4 "${D2[@]}" --json ;;
  single_tiny) CUDA_VISIBLE_DEVICES=0 run $stage $limit moegraph capture --json ;;
  single_4l) CUDA_VISIBLE_DEVICES=0 run $stage $limit moegraph capture --profile $L4 --json ;;
  cuda_tests) echo "== cuda tests"; timeout "$limit" python3 -m pytest -q -m cuda tests/gpu \
               -p no:cacheprovider > "$out/runs/cuda_tests.log" 2>&1; echo "rc=$?";
               tail -3 "$out/runs/cuda_tests.log" ;;
  *) echo "unknown stage $stage" ;;
esac; done
python3 benchmarks/distributed.py "$out/runs" > "$out/distributed.json"
tar -czf "$out/logs.tar.gz" -C "$out" runs
