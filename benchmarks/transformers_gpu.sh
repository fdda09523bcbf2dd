#!/usr/bin/env bash
# Issue 19's GPU work (the transformers inference backend), in phases that each fit one 10-minute
# device call (the machine has no vLLM; benchmarks/device_setup.sh installs prime first):
#   bash benchmarks/transformers_gpu.sh tests      # the backend's GPU tests, contract suite and engine tests
#   bash benchmarks/transformers_gpu.sh 0.6b-async 0.6b-sync 1.7b-async 1.7b-sync   # prime run, one GPU
#   bash benchmarks/transformers_gpu.sh table      # the table of everything under $OUT
# Each run phase is one `prime run` (transformers_rl_bench.py); GPUS=2 splits inference and trainer over two
# GPUs instead of sharing GPU 0. Results: $OUT/results.jsonl; each run's metrics and logs in $OUT/<shape>-async<k>/
# (models and checkpoints stay in /tmp: gigabytes).
# Knobs (environment): STEPS (10), BATCH (256 samples), MAX_TOKENS (256), UTIL (0.35 of the GPU for inference).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/prime-transformers}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
bench() {  # bench SHAPE ASYNC_LEVEL
  timeout 580 python3 benchmarks/transformers_rl_bench.py --out "$OUT" --work /tmp/prime-transformers-runs \
    --models /tmp/prime-transformers-models --shapes "$1" --async-levels "$2" \
    --gpus "${GPUS:-1}" --steps "${STEPS:-10}" --batch-size "${BATCH:-256}" --max-tokens "${MAX_TOKENS:-256}" \
    --gpu-memory-utilization "${UTIL:-0.35}" --timeout 420 || echo "bench $1 async_level=$2 exited $?"
}
for phase in "$@"; do
  case "$phase" in
    tests)
      timeout 560 python3 -m pytest -q -p no:cacheprovider -rs -s plugins/inference/transformers/tests/test_gpu.py \
        plugins/inference/transformers/tests/test_contract.py plugins/inference/transformers/tests/test_engine.py \
        > "$OUT/tests.log" 2>&1
      grep -i "mismatch KL" "$OUT/tests.log"; tail -15 "$OUT/tests.log" ;;
    0.6b-async) bench qwen3-0.6b 1 ;;
    0.6b-sync) bench qwen3-0.6b 0 ;;
    1.7b-async) bench qwen3-1.7b 1 ;;
    1.7b-sync) bench qwen3-1.7b 0 ;;
    table) python3 benchmarks/transformers_rl_bench.py table --out "$OUT" ;;
    *) echo "unknown phase $phase (tests, 0.6b-async, 0.6b-sync, 1.7b-async, 1.7b-sync, table)"; exit 2 ;;
  esac
done
