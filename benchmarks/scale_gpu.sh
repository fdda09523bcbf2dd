#!/usr/bin/env bash
# Issue 20's GPU phases (one 10-minute device call each; CUDA_VISIBLE_DEVICES picks the GPUs):
#   bash benchmarks/scale_gpu.sh tests      # 1 GPU: fast defaults on a GPU, the ring's flash block kernel
#   bash benchmarks/scale_gpu.sh tests4     # 4 GPUs: EP/CP parity with NCCL (ep 2 x dp_mod_ep 2), the flash ring
#   bash benchmarks/scale_gpu.sh ring       # 1 GPU: ring block kernel vs the fused kernel alone (ring_block_bench.py)
#   bash benchmarks/scale_gpu.sh defaults   # 1 GPU: HF step, prime's defaults, the best knobs; 8k, dense 1.7B
#   bash benchmarks/scale_gpu.sh master     # 1 GPU: fp32 master weights in one process, the casts vs FSDP
#                                           # (KNOBS; BASELINE=DIR: an earlier prime_core / prime_plugin_fsdp first on PYTHONPATH, running
#                                           # BASELINE_KNOBS into $OUT/baseline)
#   bash benchmarks/scale_gpu.sh moe        # 1 GPU: the 2.9B MoE shape at 8k, the recorded config vs the defaults
#                                           # (RECIPES; HF=1: the plain HF MoE step first; BASELINE=DIR as for master)
#   bash benchmarks/scale_gpu.sh adamw      # 1 GPU: the fused master-weight update's tests, and its time vs unfused
#   bash benchmarks/scale_gpu.sh moeprof    # 1 GPU: the MoE shape with the defaults, one step's GPU kernels by time
#                                           # (TRACE=1: with the Python calls, and the step's Chrome trace)
#   bash benchmarks/scale_gpu.sh head       # 1 GPU: the LM head's GPU tests, then its time and memory (kernels_bench)
# Results under $OUT (ring_block.jsonl, results.jsonl + hf.json, parallel.jsonl), logs beside them. Every
# trainer run records prime plan's prediction (predicted_peak_gib) beside its measured peak.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/prime-scale}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -c "import prime_core, prime_plugin_cp" 2>/dev/null || {
  bash benchmarks/device_setup.sh > "$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
}
model=/tmp/qwen3-1.7b-random
for phase in "$@"; do
  case "$phase" in
    tests)
      timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py -k fast_defaults \
        > "$OUT/scale_tests.log" 2>&1
      timeout 200 python3 -m pytest -q -p no:cacheprovider -rs plugins/parallel/cp/tests/test_flash_block.py \
        >> "$OUT/scale_tests.log" 2>&1
      grep -E "passed|failed|error" "$OUT/scale_tests.log" ;;
    tests4)
      timeout 380 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py -k expert \
        > "$OUT/scale_tests4.log" 2>&1
      timeout 180 python3 -m pytest -q -p no:cacheprovider -rs plugins/parallel/cp/tests/test_cp_plugin.py \
        -k flash_ring >> "$OUT/scale_tests4.log" 2>&1
      grep -E "passed|failed|error" "$OUT/scale_tests4.log" ;;
    ring)
      timeout 250 python3 benchmarks/ring_block_bench.py --tokens 131072 --cp 4 --no-eager \
        --out "$OUT/ring_block.jsonl" > "$OUT/ring_block.log" 2>&1 || echo "ring bench exited $?"
      timeout 250 python3 benchmarks/ring_block_bench.py --tokens 32768 --cp 4 --samples 4 \
        --out "$OUT/ring_block.jsonl" >> "$OUT/ring_block.log" 2>&1 || echo "ring bench (packed) exited $?"
      grep summary "$OUT/ring_block.jsonl" ;;
    defaults)
      timeout 120 python3 benchmarks/trainer_memory.py model --model-dir $model --out "$OUT" > "$OUT/defaults.log" 2>&1
      timeout 120 python3 benchmarks/hf_baseline.py --seq-lens 8192 --output-json "$OUT/hf.json" \
        >> "$OUT/defaults.log" 2>&1 || echo "hf baseline exited $?"
      timeout 330 python3 benchmarks/trainer_memory.py knobs --model-dir $model --out "$OUT" --seq-lens 8192 \
        --knobs fast_defaults custom_fast custom_fast_bf16 --warmup 2 --steps 6 >> "$OUT/defaults.log" 2>&1
      python3 benchmarks/trainer_memory.py table --out "$OUT" ;;
    master)
      timeout 120 python3 benchmarks/trainer_memory.py model --model-dir $model --out "$OUT" > "$OUT/master.log" 2>&1
      timeout 120 python3 benchmarks/hf_baseline.py --seq-lens 8192 --output-json "$OUT/hf.json" \
        >> "$OUT/master.log" 2>&1 || echo "hf baseline exited $?"
      for where in now ${BASELINE:+baseline}; do
        dir=$OUT knobs=${KNOBS:-fast_defaults}
        [ "$where" = baseline ] && dir=$OUT/baseline knobs=${BASELINE_KNOBS:-fast_defaults custom_fast} \
          && mkdir -p "$dir" && cp "$OUT/hf.json" "$dir/"
        PYTHONPATH=${BASELINE:+$([ "$where" = baseline ] && realpath "$BASELINE")} timeout 220 python3 \
          benchmarks/trainer_memory.py knobs --model-dir $model --out "$dir" --seq-lens 8192 \
          --knobs $knobs --warmup 2 --steps 6 >> "$OUT/master.log" 2>&1 \
          || echo "knobs ($where) exited $?"
        echo "== $where"; python3 benchmarks/trainer_memory.py table --out "$dir"
      done ;;
    moe)  # RECIPES (default: default fast-defaults); HF=1: the plain HF MoE step first; BASELINE=DIR as for master; STEPS timed (3)
      if [ -n "${HF:-}" ]; then
        timeout 150 python3 benchmarks/hf_baseline.py --moe --seq-lens 8192 --output-json "$OUT/hf_moe.json" \
          >> "$OUT/moe.log" 2>&1 || echo "hf moe baseline exited $?"
        grep -E "tok/s|tokens/s" "$OUT/moe.log" | tail -2
      fi
      for where in now ${BASELINE:+baseline}; do
        dir=$OUT; [ "$where" = baseline ] && dir=$OUT/baseline && mkdir -p "$dir"
        for recipe in ${RECIPES:-default fast-defaults}; do
          PYTHONPATH=${BASELINE:+$([ "$where" = baseline ] && realpath "$BASELINE")} timeout 250 python3 \
            -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/parallel_bench.py moe \
            --ep 1 --recipe $recipe --seq-lens 8192 --samples-per-group 1 --warmup 1 --steps ${STEPS:-3} --out "$dir" \
            > "$dir/moe-$recipe.log" 2>&1 || echo "moe $recipe ($where) exited $?"
          echo "== $where"; grep -E "^moe " "$dir/moe-$recipe.log"
        done
      done ;;
    adamw)  # the fused update's tests and its kernel against the unfused path (kernels_bench.py adamw)
      timeout 200 python3 -m pytest -q -p no:cacheprovider -rs plugins/parallel/fsdp/tests/test_adamw.py \
        plugins/parallel/fsdp/tests/test_one_process.py -m "gpu or not gpu" > "$OUT/adamw_tests.log" 2>&1
      grep -E "passed|failed|error" "$OUT/adamw_tests.log"
      timeout 200 python3 benchmarks/kernels_bench.py adamw --reps 5 --out "$OUT" > "$OUT/adamw.log" 2>&1 \
        || { echo "adamw bench exited $?"; tail -5 "$OUT/adamw.log"; }
      python3 benchmarks/kernels_bench.py table --out "$OUT" ;;
    moeprof)  # RECIPES: parallel_bench.py's --recipe values, one run each; PIPELINED=1: three steps, pipelined
      for recipe in ${RECIPES:-fast-defaults fast-bf16}; do
        timeout 250 python3 -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/parallel_bench.py \
          moe --ep 1 --recipe $recipe --seq-lens 8192 --samples-per-group 1 --warmup 1 --steps 3 --profile ${TRACE:+--trace} ${PIPELINED:+--pipelined} \
          --out "$OUT" >> "$OUT/moeprof.log" 2>&1 || echo "moe profile $recipe exited $?"
      done
      grep -E "^moe " "$OUT/moeprof.log"; head -${PROFILE_LINES:-32} "$OUT"/profile-*.txt ;;
    head)
      timeout 200 python3 -m pytest -q -p no:cacheprovider -rs plugins/kernels/fused-lm-head/tests \
        > "$OUT/head_tests.log" 2>&1
      grep -E "passed|failed|error" "$OUT/head_tests.log"
      timeout 200 python3 benchmarks/kernels_bench.py lm_head --out "$OUT" > "$OUT/head.log" 2>&1 \
        || echo "kernels bench exited $?"
      python3 benchmarks/kernels_bench.py table --out "$OUT" ;;
    *) echo "unknown phase $phase (tests, tests4, ring, defaults, master, moe, moeprof, adamw, head)"; exit 2 ;;
  esac
done
exit 0
