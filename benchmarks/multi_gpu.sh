#!/usr/bin/env bash
# Issue 21's runs on a machine of 4 GPUs, in phases that together fit one or two 10-minute device calls:
#   bash benchmarks/multi_gpu.sh fsdp      # dense 1.7B, fp32 master weights, the fast defaults, at 8k: 1, 2, 4 GPUs
#   bash benchmarks/multi_gpu.sh cp4       # CP = 4 at 32k and 131k, ring (flash block kernel) vs ulysses
#   bash benchmarks/multi_gpu.sh longest   # the longest sequence CP = 4 trains (ulysses, then the ring)
#   bash benchmarks/multi_gpu.sh rl        # prime run: inference on GPU 0 (transformers), trainer on GPUs 1-3
#   bash benchmarks/multi_gpu.sh table     # every table of what $OUT holds
# Results under $OUT: results.jsonl (fsdp), parallel.jsonl (cp4, longest), rl/results.jsonl (rl); logs beside them.
# Each phase has its own time limit so that a slow one cannot starve the rest of the call.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/prime-multi}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -c "import prime_core, prime_plugin_cp" 2>/dev/null || {
  bash benchmarks/device_setup.sh > "$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
}
model=/tmp/qwen3-1.7b-random
run() {  # run GPUS TIMEOUT LOG COMMAND...
  local gpus=$1 limit=$2 log=$3; shift 3
  CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((gpus - 1))) timeout "$limit" "$@" >> "$OUT/$log" 2>&1 \
    || echo "exited $?: $*" | tee -a "$OUT/$log"
}
tr="python3 -m torch.distributed.run --standalone --nproc-per-node"  # timeout runs programs, not functions
for phase in "$@"; do
  case "$phase" in
    fsdp)
      timeout 120 python3 benchmarks/trainer_memory.py model --model-dir $model --out "$OUT" >> "$OUT/fsdp.log" 2>&1
      for n in 1 2 4; do
        run "$n" 150 fsdp.log $tr "$n" benchmarks/trainer_memory.py scaling --model-dir $model --out "$OUT" \
          --knob fast_defaults --seq-len 8192 --samples-per-rank 2 --warmup 2 --steps 4
      done
      grep -E "^scaling" "$OUT/fsdp.log" ;;
    cp4)
      for style in ulysses ring; do
        run 4 150 cp4.log $tr 4 benchmarks/parallel_bench.py cp --cp 4 --style $style --recipe fast-defaults \
          --seq-lens 32768 131072 --warmup 1 --steps 2 --out "$OUT" --model-root /tmp/prime-bench-models
      done
      grep -E "^cp " "$OUT/cp4.log" ;;
    longest)  # each length takes about (length / 131072)^2 times the 131k step: a few lengths per style
      run 4 170 longest.log $tr 4 benchmarks/parallel_bench.py cp --cp 4 --style ulysses --recipe fast-defaults \
        --seq-lens 262144 393216 524288 --warmup 0 --steps 1 --out "$OUT" --model-root /tmp/prime-bench-models
      run 4 100 longest.log $tr 4 benchmarks/parallel_bench.py cp --cp 4 --style ring --recipe fast-defaults \
        --seq-lens 262144 --warmup 0 --steps 1 --out "$OUT" --model-root /tmp/prime-bench-models
      grep -E "^cp " "$OUT/longest.log" ;;
    rl)
      run 4 280 rl.log python3 benchmarks/transformers_rl_bench.py --out "$OUT/rl" --work /tmp/prime-rl-work \
        --shapes qwen3-0.6b --gpus 4 --async-levels 1 --steps 5 --skip 2 --timeout 250
      tail -4 "$OUT/rl.log" ;;
    table)
      [ -f "$OUT/results.jsonl" ] && python3 benchmarks/trainer_memory.py table --out "$OUT"
      [ -f "$OUT/parallel.jsonl" ] && python3 benchmarks/parallel_bench.py table --out "$OUT"
      [ -f "$OUT/rl/results.jsonl" ] && python3 benchmarks/transformers_rl_bench.py table --out "$OUT/rl" ;;
    *) echo "unknown phase $phase (fsdp, cp4, longest, rl, table)"; exit 2 ;;
  esac
done
exit 0
