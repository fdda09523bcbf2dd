#!/usr/bin/env bash
# Issue 6's GPU work on one GPU (CUDA_VISIBLE_DEVICES picks it), in phases:
#   bash benchmarks/kernels_gpu.sh tests   # Triton LM head, FP8 (incl. 200-step FP8 vs bf16), liger, custom CUDA
#   bash benchmarks/kernels_gpu.sh bench   # LM head peak memory/time at V = 151,936; FP8 TFLOP/s vs bf16
#   bash benchmarks/kernels_gpu.sh step    # whole training step vs the plain HF step (8k, 32k), same job
#   bash benchmarks/kernels_gpu.sh attention   # attention kernels per row shape (attention_bench.py)
#   bash benchmarks/kernels_gpu.sh deepgemm    # build DeepGEMM (deepgemm_build.sh), its FP8 tests, the host
#                                              # time of each piece (fp8_host, deep_gemm and torch), the FP8
#                                              # linear on deep_gemm eager, compiled and CUDA-graphed beside bf16
#                                              # (~5.5 min: the build ~80 s, tests with the JIT warm-up ~160 s)
#   bash benchmarks/kernels_gpu.sh fp8step     # the compiled 1.7B step at 8k, bf16 against FP8 (DeepGEMM if built)
#   bash benchmarks/kernels_gpu.sh fp8rows     # the same with 4 rows a step: FP8 with and without the weight cache
#   bash benchmarks/kernels_gpu.sh quant       # the FP8 quantisers' tests compiled, and their launches timed at
#                                              # M = 8,192 on every block width (kernels_bench.py quant,
#                                              # quant_rows); QUANT_ONLY=rows: quant_rows alone
# Results under $OUT: kernels.jsonl, results.jsonl + hf.json (trainer_memory.py table), logs.
# Needs prime installed (benchmarks/device_setup.sh); liger-kernel from benchmarks/.whl/extras if carried (fetch_device_wheels.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/prime-kernels}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
deepgemm_on_path() {  # build DeepGEMM unless python3 imports it already; 1 when it cannot
  export DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-/tmp/deepgemm-jit}
  python3 -c 'import deep_gemm' 2> /dev/null && return 0
  local dg
  dg=$(timeout 420 bash benchmarks/deepgemm_build.sh 2>> "$OUT/deepgemm_build.log") \
    || { tail -30 "$OUT/deepgemm_build.log"; return 1; }
  tail -3 "$OUT/deepgemm_build.log"
  export PYTHONPATH=$dg${PYTHONPATH:+:$PYTHONPATH}
}
for phase in "$@"; do
  case "$phase" in
    tests)
      timeout 420 python3 -m pytest -q -p no:cacheprovider -rs plugins/kernels/fused-lm-head/tests/test_triton_impl.py \
        plugins/kernels/fp8/tests/test_gpu.py plugins/kernels/liger/tests/test_liger_gpu.py \
        plugins/models/custom/tests/test_cuda.py plugins/kernels/flash-attn/tests/test_flash_attn_gpu.py \
        > "$OUT/kernel_tests.log" 2>&1
      tail -15 "$OUT/kernel_tests.log" ;;
    bench)
      timeout 240 python3 benchmarks/kernels_bench.py lm_head --tokens 8192 16384 32768 65536 --out "$OUT" \
        > "$OUT/kernels_bench.log" 2>&1 || echo "lm_head bench exited $?"
      timeout 150 python3 benchmarks/kernels_bench.py fp8 --tokens 8192 --out "$OUT" >> "$OUT/kernels_bench.log" 2>&1 \
        || echo "fp8 bench exited $?"
      python3 benchmarks/kernels_bench.py table --out "$OUT" ;;
    step)
      model=/tmp/qwen3-1.7b-random
      timeout 120 python3 benchmarks/trainer_memory.py model --model-dir $model --out "$OUT" > "$OUT/step.log" 2>&1
      timeout 150 python3 benchmarks/hf_baseline.py --seq-lens 8192 32768 --output-json "$OUT/hf.json" \
        >> "$OUT/step.log" 2>&1 || echo "hf baseline exited $?"
      timeout 200 python3 benchmarks/trainer_memory.py knobs --model-dir $model --out "$OUT" --seq-lens 8192 \
        --knobs custom_fast custom_fast_bf16 --warmup 2 --steps 6 >> "$OUT/step.log" 2>&1
      timeout 120 python3 benchmarks/trainer_memory.py knobs --model-dir $model --out "$OUT" --seq-lens 32768 \
        --knobs custom_ac_fast --warmup 1 --steps 3 >> "$OUT/step.log" 2>&1
      python3 benchmarks/trainer_memory.py table --out "$OUT" ;;
    attention)
      timeout 120 python3 benchmarks/attention_bench.py --tokens 8192 32768 --samples 1 8 --out "$OUT" ;;
    deepgemm)
      deepgemm_on_path || continue
      # The JIT compiles a kernel per (N, K) at first use, one at a time: warm them in parallel.
      layers=$(python3 -c 'import sys; sys.path.insert(0, "benchmarks"); import kernels_bench as k
print(" ".join(f"{m}:{l}" for m, s in k.FP8_SHAPES.items() for l in s))')
      start=$(date +%s)
      # (the warm-up compiles on the CPU while the tests, which compile their own small shapes, run)
      printf '%s\n' $layers | xargs -P 8 -I{} timeout 300 python3 benchmarks/kernels_bench.py fp8 --backends deep_gemm \
        --tokens 8192 --layers {} --reps 1 --out /tmp/deepgemm-warm > "$OUT/deepgemm_warm.log" 2>&1 &
      warm=$!
      timeout 300 python3 -m pytest -q -p no:cacheprovider -rs plugins/kernels/fp8/tests/test_triton_quant.py \
        plugins/kernels/fp8/tests/test_gpu.py > "$OUT/deepgemm_tests.log" 2>&1; tail -5 "$OUT/deepgemm_tests.log"
      wait $warm || echo "warm-up exited $? (log: deepgemm_warm.log)"
      echo "tests and JIT warm-up: $(( $(date +%s) - start )) s"
      timeout 120 python3 benchmarks/kernels_bench.py fp8_host --backends deep_gemm torch --reps 200 --out "$OUT" \
        > "$OUT/fp8_host.log" 2>&1 || echo "fp8_host exited $?"
      # deep_gemm only unless FP8_BACKENDS says (torch's rows: stop 40): each shape also compiles
      # three linears (~5 s each).
      timeout 480 python3 benchmarks/kernels_bench.py fp8 --backends ${FP8_BACKENDS:-deep_gemm} --tokens 8192 --reps 10 \
        --out "$OUT" \
        > "$OUT/deepgemm_bench.log" 2>&1 || echo "fp8 bench exited $?"
      grep '"fp8_quant"' "$OUT/kernels.jsonl" | cut -c1-200
      python3 benchmarks/kernels_bench.py table --out "$OUT" ;;
    fp8step)
      # The whole step (Qwen3-1.7B shape, 8k tokens, compiled), bf16 against FP8 in one job. FP8's
      # `auto` backend is DeepGEMM once built (by the deepgemm phase before this one, or here).
      deepgemm_on_path || echo "no DeepGEMM: FP8 runs on torch's GEMMs"
      model=/tmp/qwen3-1.7b-random
      [ -d $model ] || timeout 120 python3 benchmarks/trainer_memory.py model --model-dir $model --out "$OUT" \
        > "$OUT/fp8step.log" 2>&1
      # FP8's first steps compile DeepGEMM's kernels for the model's shapes: 6 warm-up steps, where
      # 3 once left the FP8 step at 0.93x bf16 with its timed steps still warming up (225 ms median,
      # std 12.7 ms; with 6: 194 ms, std 3-5 ms, stop 64).
      timeout 540 python3 benchmarks/trainer_memory.py knobs --model-dir $model --out "$OUT" --seq-lens 8192 \
        --knobs custom_compile custom_fp8_compile custom_fp8_bf16_wgrad_compile --warmup 6 --steps 10 >> "$OUT/fp8step.log" 2>&1 \
        || echo "fp8 step exited $? (log: fp8step.log)"
      python3 benchmarks/trainer_memory.py table --out "$OUT" ;;
    fp8rows)
      # A step of 4 rows of 8,192 tokens (4 passes): bf16, FP8 quantising every weight in every
      # pass, and FP8 with the weight cache (the default: passes 2-4 reuse the first's blocks).
      deepgemm_on_path || echo "no DeepGEMM: FP8 runs on torch's GEMMs"
      model=/tmp/qwen3-1.7b-random
      [ -d $model ] || timeout 120 python3 benchmarks/trainer_memory.py model --model-dir $model --out "$OUT" \
        > "$OUT/fp8rows.log" 2>&1
      knobs=${FP8ROWS_KNOBS:-custom_compile custom_fp8_bf16_wgrad_compile custom_fp8_cached_compile}
      timeout 560 python3 benchmarks/trainer_memory.py knobs --model-dir $model --out "$OUT" --seq-lens 8192 \
        --samples-per-rank 4 --kind fp8_4rows --knobs $knobs --warmup 4 --steps 8 >> "$OUT/fp8rows.log" 2>&1 \
        || echo "fp8rows exited $? (log: fp8rows.log)"
      python3 benchmarks/trainer_memory.py table --out "$OUT" ;;
    quant)
      timeout 200 python3 -m pytest -q -p no:cacheprovider plugins/kernels/fp8/tests/test_triton_quant.py \
        > "$OUT/quant_tests.log" 2>&1; tail -2 "$OUT/quant_tests.log"
      [ "${QUANT_ONLY:-}" = rows ] || timeout 300 python3 benchmarks/kernels_bench.py quant --tokens 8192 --out "$OUT" \
        ${QUANT_LAUNCH:+--launch $QUANT_LAUNCH} > "$OUT/quant.log" 2>&1 || { echo "quant bench exited $?"; tail -5 "$OUT/quant.log"; }
      timeout 300 python3 benchmarks/kernels_bench.py quant_rows --tokens 8192 --out "$OUT" \
        > "$OUT/quant_rows.log" 2>&1 || { echo "quant_rows bench exited $?"; tail -5 "$OUT/quant_rows.log"; }
      python3 benchmarks/kernels_bench.py table --out "$OUT" ;;
    *) echo "unknown phase $phase (tests, bench, step, attention, deepgemm, fp8step, fp8rows, quant)"; exit 2 ;;
  esac
done
exit 0
