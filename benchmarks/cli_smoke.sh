#!/usr/bin/env bash
# The CLI end to end on the GPU with its human-readable output (tiny default profile).
set -u
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
run() { echo "\$ moegraph $*"; timeout 60 moegraph "$@"; echo "exit $?"; }
run capture --scopes attn,moe --steps 5 --warmup 2
run verify --lr0 --steps 3
run verify --no-lr0 --steps 3 --reference transformers
run plan --budget auto --out /tmp/plan.yaml
run capture --plan /tmp/plan.yaml --steps 3 --warmup 1 --memory-limit 8GiB
