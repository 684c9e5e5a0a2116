#!/usr/bin/env bash
# The suite on a GPU machine: install the package, then run the named stages in order, each
# under its own time limit. Each stage writes its JSON (with the GPU, torch and Triton
# versions, the commit and the date) to $OUT/NAME.json (a test stage: $OUT/STAGE_tests.json,
# the pytest summary line) and its log to $OUT/logs/STAGE.log; OUT defaults to
# benchmarks/results. In a tree that is not a git checkout (an export), set MOEGRAPH_COMMIT to
# the commit it was exported from: the JSON records it as the run's commit.
#
#   bash benchmarks/run_gpu.sh STAGE[:SECONDS] ...      (default limit 600 s a stage)
#
# Stages:
#   kernels      the kernels' CUDA tests (tests/kernels, the expert, fused, embedding and
#                route-list GPU tests, the optimizer and loss kernels), -m cuda
#   tests        every CUDA test (-m cuda tests/)
#   experts      benchmarks/experts.py --check, uniform and skewed routing
#   whole_step   benchmarks/whole_step.py: eager / attn+moe / step graph, by part, against
#                transformers eager and compiled
#   capture      benchmarks/capture.py: eager vs graph per pool strategy, verify --lr0
#   families     benchmarks/capture.py --families: every family, both MoE modes, fp32 reference
#   planner      benchmarks/planner.py: the out-of-memory a plan avoids, predicted vs measured
#   micro        benchmarks/optimizer.py and benchmarks/loss.py
#   distributed  benchmarks/distributed.py (needs 2 GPUs; skipped with fewer)
#   all          kernels experts whole_step capture planner micro, and distributed with 2 GPUs
#   load         the speed-at-load table, its three stages in order (on an H200 for its goals):
#   load_experts   experts.py --check, T = 1024 / 8192 / 32768, uniform and skewed, the default
#                  beside permute_free_keep and permute + grouped_mm, 7 rounds
#   load_step      whole_step.py, qwen3-30b-a3b-4layer at 4 x 4096 with run.recompute=keep (the
#                  plan's choice where memory allows), eager and step graph by part, against
#                  transformers eager and + torch.compile
#   small_step     whole_step.py, tiny-qwen3-moe and qwen3-30b-a3b-4layer at 1 x 1024
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}; export OUT
mkdir -p "$OUT/logs"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/logs/install.log" 2>&1 \
  || { cat "$OUT/logs/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv \
  > "$OUT/logs/gpu.txt" 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__,
torch.cuda.get_device_name(), torch.cuda.device_count())" >> "$OUT/logs/gpu.txt" 2>&1
cat "$OUT/logs/gpu.txt"
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)

PYTEST="python3 -m pytest -q -m cuda -p no:cacheprovider"
KERNEL_TESTS="tests/kernels tests/gpu/test_experts_cuda.py tests/gpu/test_gpt_oss_experts_cuda.py \
  tests/gpu/test_fused_cuda.py tests/gpu/test_embedding_backward_cuda.py \
  tests/gpu/test_route_align_cuda.py tests/test_optim.py tests/test_loss.py"

command_of() {
  case $1 in
    kernels) echo "$PYTEST $KERNEL_TESTS" ;;
    tests) echo "$PYTEST tests" ;;
    experts) echo "python3 benchmarks/experts.py --check --routing uniform,skewed" \
                  "--out $OUT/experts.json" ;;
    whole_step) echo "python3 benchmarks/whole_step.py --out $OUT/whole_step.json" ;;
    load_experts) echo "python3 benchmarks/experts.py --check --shapes qwen3" \
                       "--tokens 1024,8192,32768 --routing uniform,skewed" \
                       "--impls permute_free,grouped_mm_baseline,permute_free_keep --rounds 7" \
                       "--out $OUT/experts_load.json" ;;
    load_step) echo "python3 benchmarks/whole_step.py --only qwen3-30b-a3b-4layer --ops 0" \
                    "--kernels 12 --graph-modes step --no-verify --steps 10 --hf-timeout 100" \
                    "--set run.batch=4 --set run.seq_len=4096 --set run.recompute=keep" \
                    "--out $OUT/whole_step_load.json" ;;
    small_step) echo "python3 benchmarks/whole_step.py --only tiny-qwen3-moe,qwen3-30b-a3b-4layer" \
                     "--transformers '' --ops 0 --no-verify --steps 20" \
                     "--out $OUT/whole_step_small.json" ;;
    capture) echo "python3 benchmarks/capture.py --out $OUT/capture.json" ;;
    families) echo "python3 benchmarks/capture.py --families --out $OUT/families.json" ;;
    planner)  # against this run's families.json where there is one, else the recorded file
      local measured=""; [ -f "$OUT/families.json" ] && measured="--measured $OUT/families.json"
      echo "python3 benchmarks/planner.py $measured --out $OUT/planner.json" ;;
    micro) echo "python3 benchmarks/optimizer.py --out $OUT/optimizer.json &&" \
                "python3 benchmarks/loss.py --out $OUT/loss.json" ;;
    distributed)
      if [ "$gpus" -ge 2 ]; then
        echo "python3 benchmarks/distributed.py --out $OUT/distributed.json"
      else
        echo "echo 'distributed: needs 2 GPUs, this machine has $gpus'"
      fi ;;
    *) return 1 ;;
  esac
}

group_of() {  # the stages a group name stands for
  case $1 in
    all) echo "kernels experts whole_step capture planner micro distributed" ;;
    load) echo "load_experts load_step small_step" ;;
    *) return 1 ;;
  esac
}

stages=()
for arg in "$@"; do
  if members=$(group_of "${arg%%:*}"); then  # GROUP:SECONDS gives each stage that limit
    tail=""; [ "$arg" != "${arg%%:*}" ] && tail=":${arg#*:}"
    for s in $members; do stages+=("$s$tail"); done
  else
    stages+=("$arg")
  fi
done
[ ${#stages[@]} -gt 0 ] || { sed -n '2,30p' "$0"; exit 2; }

tests_json() {  # STAGE RC COMMAND: a test stage's record, its pytest summary line
  python3 - "$@" "$OUT/logs/$1.log" "$OUT/$1_tests.json" <<'PY'
import sys
sys.path.insert(0, "benchmarks")
from common import environment, write_json
stage, rc, cmd, log, out = sys.argv[1:]
lines = [ln for ln in open(log, errors="replace").read().splitlines() if ln.strip()]
write_json(out, {"benchmark": f"{stage} tests", **environment(), "command": cmd,
                 "returncode": int(rc), "summary": lines[-1] if lines else None})
PY
}

status=0
for arg in "${stages[@]}"; do
  stage=${arg%%:*}; limit=${arg#*:}; [ "$limit" = "$arg" ] && limit=600
  cmd=$(command_of "$stage") || { echo "unknown stage $stage"; status=2; continue; }
  echo "=== $stage (limit ${limit}s): $cmd"
  start=$(date +%s)
  timeout -k 10 "$limit" bash -c "$cmd" > "$OUT/logs/$stage.log" 2>&1
  rc=$?
  echo "=== $stage rc=$rc in $(( $(date +%s) - start ))s"
  tail -n 25 "$OUT/logs/$stage.log"
  case $stage in kernels|tests) tests_json "$stage" "$rc" "$cmd" ;; esac
  [ $rc = 0 ] || status=1
done
exit $status
