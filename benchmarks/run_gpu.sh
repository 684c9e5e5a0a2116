#!/usr/bin/env bash
# One device-machine session: install, then the named stages, each under its own time limit,
# logs and JSON under $OUT. Usage: bash benchmarks/run_gpu.sh STAGE[:SECONDS] ...
# Stages: tests, kernels_tests, graphs_tests, eager, experts, experts_sweep, capture, planner, profile,
# and for the whole step (issue 9): step_tests, whole_step, expert_breakdown, optimizer, loss, variants
# and for the families (issue 10): families_tests, architectures
# and this round's kernels: fused_tests, new_tests, rest_tests, wgrad_sweep, architectures_new,
# sink_attention (GPT-OSS's attention choices), slice_reference (fp32 logits vs transformers on the slices),
# experts_forward (the whole expert forward graphed at T = 8192 and 32768, TFLOP/s),
# combine_sweep (the gather-combine tile; its winner is exported to the stages after it),
# fc1_sweep / fc2_sweep (the FC1 / FC2 tile at 128-row blocks, likewise exported),
# slice_reference_qwen2, tail_tests (the slot-GEMM variants, the split tail among them, and the expert path),
# experts_ab (interleaved A/B of the expert forward and FC1 / FC2: paired FC1 vs unpaired and not persistent),
# experts_small (T = 1024 fwd+bwd vs the baseline), paired_tests (the paired FC1 and the expert path on the GPU)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
WORK=/tmp/mg_work; mkdir -p "$WORK"   # everything lands here; $OUT gets one archive (file limit)
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$WORK/install.log" 2>&1 || { cat "$WORK/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv > "$WORK/gpu.txt" 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" >> "$WORK/gpu.txt"
cat "$WORK/gpu.txt"
for arg in "$@"; do
  stage=${arg%%:*}; limit=${arg#*:}; [ "$limit" = "$arg" ] && limit=300
  start=$(date +%s)
  case $stage in
    tests) cmd="python3 -m pytest -q -m cuda -p no:cacheprovider tests/gpu" ;;
    kernels_tests) cmd="python3 -m pytest -q -m cuda -p no:cacheprovider tests/gpu/test_experts_cuda.py" ;;
    graphs_tests) cmd="python3 -m pytest -q -m cuda -p no:cacheprovider tests/gpu/test_graphs_cuda.py" ;;
    eager) cmd="python3 benchmarks/eager_baseline.py --out $WORK/eager_baseline.json" ;;
    experts) cmd="python3 benchmarks/moe_experts.py --check --out $WORK/moe_experts.json" ;;
    experts_sweep) cmd="python3 benchmarks/moe_experts.py --check --sweep --quick --out $WORK/moe_experts_sweep.json" ;;
    capture) cmd="python3 benchmarks/capture.py --out $WORK/capture.json" ;;
    capture_12_entry) cmd="python3 benchmarks/capture.py --only qwen3-30b-a3b-12layer --pools per_entry --out $WORK/capture_12_entry.json" ;;
    capture_12_pooled) cmd="python3 benchmarks/capture.py --only qwen3-30b-a3b-12layer --pools shared,per_scope --out $WORK/capture_12_pooled.json" ;;
    capture_fast) cmd="python3 benchmarks/capture.py --only tiny-qwen3-moe,qwen3-30b-a3b-4layer --out $WORK/capture_fast.json" ;;
    planner_tests) cmd="python3 -m pytest -q -m cuda -p no:cacheprovider tests/gpu/test_planner_cuda.py" ;;
    planner) cmd="python3 benchmarks/planner.py --no-steady --out $WORK/planner.json" ;;
    profile) cmd="python3 benchmarks/planner.py --mode profile-tiny --out $WORK/profile_tiny.json" ;;
    step_tests) cmd="python3 -m pytest -q -m cuda -p no:cacheprovider tests/gpu tests/test_optim.py tests/test_loss.py" ;;
    whole_step) cmd="python3 benchmarks/whole_step.py --out $WORK/whole_step.json" ;;
    expert_breakdown) cmd="python3 benchmarks/expert_breakdown.py --out $WORK/expert_breakdown.json" ;;
    optimizer) cmd="python3 benchmarks/optimizer.py --out $WORK/optimizer.json" ;;
    loss) cmd="python3 benchmarks/loss.py --out $WORK/loss.json" ;;
    step_ops) cmd="python3 benchmarks/step_ops.py --out $WORK/step_ops.json" ;;
    variants_tests) cmd="python3 -m pytest -q -m cuda -p no:cacheprovider tests/kernels/test_slot_gemm_variants.py" ;;
    variants) cmd="python3 benchmarks/moe_experts.py --variants --out $WORK/moe_variants.json" ;;
    fused_tests) cmd="python3 -m pytest -q -m cuda -p no:cacheprovider tests/gpu/test_fused_cuda.py tests/kernels/test_rmsnorm.py tests/kernels/test_rope.py tests/kernels/test_combine.py" ;;
    new_tests) cmd="python3 -m pytest -q -m cuda -p no:cacheprovider tests/gpu/test_embedding_backward_cuda.py tests/gpu/test_route_align_cuda.py tests/gpu/test_gpt_oss_experts_cuda.py" ;;
    rest_tests) cmd="python3 -m pytest -q -m cuda -p no:cacheprovider tests/gpu tests/test_optim.py tests/test_loss.py --ignore=tests/gpu/test_fused_cuda.py --ignore=tests/gpu/test_embedding_backward_cuda.py --ignore=tests/gpu/test_route_align_cuda.py --ignore=tests/gpu/test_gpt_oss_experts_cuda.py" ;;
    wgrad_sweep) cmd="python3 benchmarks/wgrad_sweep.py --out $WORK/wgrad_sweep.json" ;;
    architectures_new) cmd="python3 benchmarks/architectures.py --only tiny-gpt-oss,gpt-oss-20b-4layer,qwen1.5-moe-a2.7b-4layer --out $WORK/architectures_new.json" ;;
    fc1_sweep) cmd="python3 benchmarks/tile_sweep.py --kernel fc1 --tokens 8192 --out $WORK/fc1_sweep.json" ;;
    fc2_sweep) cmd="python3 benchmarks/tile_sweep.py --kernel fc2 --tokens 8192 --out $WORK/fc2_sweep.json" ;;
    slice_reference_qwen2) cmd="python3 benchmarks/architectures.py --reference-only qwen2-57b-a14b-4layer --out $WORK/slice_reference_qwen2.json" ;;
    combine_sweep) cmd="python3 benchmarks/combine_sweep.py --tokens 8192 --out $WORK/combine_sweep.json" ;;
    experts_forward) cmd="python3 benchmarks/expert_breakdown.py --tokens 8192,32768 --only default,grouped_mm_baseline --out $WORK/experts_forward.json" ;;
    experts_ab) cmd="python3 benchmarks/experts_ab.py --tokens 1024,8192,32768 --rounds 9 --configs fc1_unpaired,fc1_not_persistent --out $WORK/experts_ab.json" ;;
    experts_forward3) cmd="for i in 1 2 3; do python3 benchmarks/expert_breakdown.py --tokens 8192,32768 --only default,grouped_mm_baseline --out $WORK/experts_forward_\$i.json; done" ;;
    persistent_ab) cmd="python3 benchmarks/experts_ab.py --tokens 8192,32768 --rounds 9 --configs fc1_not_persistent,fc1_unpaired --out $WORK/persistent_ab.json" ;;
    p96_ab) cmd="python3 benchmarks/experts_ab.py --tokens 8192,32768 --rounds 9 --configs fc1_not_persistent,fc1_p96,fc1_p96_w4,fc1_p96_k32 --out $WORK/p96_ab.json" ;;
    experts_forward_alt) cmd="for i in 1 2; do python3 benchmarks/expert_breakdown.py --tokens 8192 --only default,fc1_not_persistent,fc1_p96,grouped_mm_baseline --out $WORK/experts_forward_alt_\$i.json; done" ;;
    p96_tests) cmd="python3 -m pytest -q -m cuda -p no:cacheprovider tests/kernels/test_slot_gemm_variants.py -k paired" ;;
    experts_small) cmd="python3 benchmarks/expert_breakdown.py --tokens 1024 --only default,grouped_mm_baseline --out $WORK/experts_small.json" ;;
    paired_tests) cmd="python3 -m pytest -q -m cuda -p no:cacheprovider tests/kernels/test_slot_gemm_variants.py::test_cuda_fc1_paired_box_is_bitwise_equal tests/gpu/test_experts_cuda.py tests/gpu/test_gpt_oss_experts_cuda.py" ;;
    paired_ab) cmd="python3 benchmarks/experts_ab.py --tokens 8192 --rounds 9 --configs fc1_unpaired,fc1_paired_persistent,fc1_paired_k128,fc1_paired_k32,fc1_paired_g8,fc1_paired_s3 --out $WORK/paired_ab.json" ;;
    tail_tests) cmd="python3 -m pytest -q -m cuda -p no:cacheprovider tests/kernels/test_slot_gemm_variants.py tests/gpu/test_experts_cuda.py" ;;
    sink_attention) cmd="python3 benchmarks/sink_attention.py --out $WORK/sink_attention.json" ;;
    slice_reference) cmd="python3 benchmarks/architectures.py --reference-only qwen3-30b-a3b-4layer,moonlight-16b-a3b-4layer,qwen1.5-moe-a2.7b-4layer,gpt-oss-20b-4layer,mixtral-8x7b-4layer,qwen2-57b-a14b-4layer --out $WORK/slice_reference.json" ;;
    families_tests) cmd="python3 -m pytest -q -m cuda -p no:cacheprovider tests/gpu/test_families_cuda.py" ;;
    architectures) cmd="python3 benchmarks/architectures.py --out $WORK/architectures.json" ;;
    *) echo "unknown stage $stage"; continue ;;
  esac
  echo "=== $stage (limit ${limit}s): $cmd"
  timeout -k 10 "$limit" bash -c "$cmd" > "$WORK/$stage.log" 2>&1
  rc=$?
  echo "=== $stage rc=$rc in $(( $(date +%s) - start ))s"
  tail -n 25 "$WORK/$stage.log"
  # A failing fused-kernel check turns the fused kernels off for the stages after it; the
  # wgrad sweep's winner is what the stages after it run with (both said in the log).
  if [ "$stage" = fused_tests ] && [ $rc != 0 ]; then export MOEGRAPH_FUSED=0; echo "MOEGRAPH_FUSED=0 from here on"; fi
  if [ "$stage" = combine_sweep ]; then
    v=$(grep -o 'MOEGRAPH_COMBINE_TILE=[0-9,]*' "$WORK/combine_sweep.log" | tail -1)
    [ -n "$v" ] && export "$v" && echo "exported $v"
  fi
  if [ "$stage" = fc1_sweep ] || [ "$stage" = fc2_sweep ]; then
    v=$(grep -o 'MOEGRAPH_FC[12]_TILE=[0-9,]*' "$WORK/$stage.log" | tail -1)
    [ -n "$v" ] && export "$v" && echo "exported $v"
  fi
  if [ "$stage" = wgrad_sweep ]; then
    v=$(grep -o 'MOEGRAPH_WGRAD_SHORT=[0-9,]*' "$WORK/wgrad_sweep.log" | tail -1)
    [ -n "$v" ] && export "$v" && echo "exported $v"
  fi
  tar czf "$OUT/run.tgz" -C "$WORK" .
done
