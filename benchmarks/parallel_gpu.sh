#!/usr/bin/env bash
# Expert/context parallelism on a 4×H200 machine, in phases that each fit one 10-minute device call:
#   bash benchmarks/parallel_gpu.sh quick|tests|tests2|moe2|moe4|cp4|cp1   (results: $OUT/parallel.jsonl, logs in $OUT)
# FIRST_GPU=N starts the GPUs a phase uses at N (2-GPU phases on GPUs 2,3 while others use 0,1).
# Each phase installs prime first if this machine has not got it yet (benchmarks/device_setup.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/prime-parallel}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
models=/tmp/prime-bench-models
first=${FIRST_GPU:-0}
python3 -c "import prime_core, prime_plugin_ep" 2>/dev/null || {
  bash benchmarks/device_setup.sh > "$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
  python3 -m pip install -q --no-index --no-deps benchmarks/.whl/test/*.whl >> "$OUT/setup.log" 2>&1
}
bench() {  # bench GPUS TIMEOUT ARGS...
  local gpus=$1 limit=$2; shift 2
  CUDA_VISIBLE_DEVICES=$(seq -s, "$first" $((first + gpus - 1))) timeout "$limit" \
    python3 -m torch.distributed.run --standalone --nproc-per-node "$gpus" benchmarks/parallel_bench.py "$@" \
    --out "$OUT" --model-root "$models" >> "$OUT/bench.log" 2>&1 || echo "bench $* exited $?" | tee -a "$OUT/bench.log"
  grep -E "^(moe|cp) " "$OUT/bench.log" | tail -3
}
case "${1:?phase}" in
  quick)  # what a few minutes allow: EP/CP parity on 2 GPUs with NCCL, then EP = 2 on the MoE model
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "expert and 2" > "$OUT/gpu_tests.log" 2>&1
    tail -3 "$OUT/gpu_tests.log"
    bench 2 130 moe --ep 2 --seq-lens 8192 --samples-per-group 2 --steps 1 ;;
  tests2)  # EP/CP parity with NCCL on 2 GPUs only
    CUDA_VISIBLE_DEVICES=$first,$((first + 1)) timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
      -k "expert and 2" > "$OUT/gpu_tests2.log" 2>&1
    tail -5 "$OUT/gpu_tests2.log" ;;
  tests)
    timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k expert \
      plugins/models/custom/tests/test_cuda.py > "$OUT/gpu_tests.log" 2>&1
    tail -5 "$OUT/gpu_tests.log" ;;
  moe2)
    bench 2 200 moe --ep 2 --seq-lens 8192 --samples-per-group 2
    bench 2 170 moe --ep 1 --seq-lens 8192 --samples-per-group 2 ;;
  moe4)
    bench 4 280 moe --ep 4 --seq-lens 8192 --samples-per-group 2
    bench 4 280 moe --ep 1 --seq-lens 8192 --samples-per-group 2 ;;
  cp4)
    bench 4 300 cp --cp 4 --style ulysses --seq-lens 32768 131072 262144 --warmup 1 --steps 1
    bench 4 280 cp --cp 4 --style ring --seq-lens 32768 131072 --warmup 1 --steps 1 ;;
  cp1)
    bench 1 400 cp --cp 1 --seq-lens 32768 65536 98304 131072 --warmup 1 --steps 1 ;;
esac
[ -f "$OUT/parallel.jsonl" ] && python3 benchmarks/parallel_bench.py table --out "$OUT"
exit 0
