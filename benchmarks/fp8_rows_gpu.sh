#!/usr/bin/env bash
# One GPU with DeepGEMM: where the FP8 step's host time goes over an RL step's rows, in one job.
#  0. the FP8 GPU tests (test_gpu.py, test_weight_cache.py);
#  1. trainer_memory.py profile --length variable, compiled 1.7B, `torch_fused`, 4 samples of 8-8,192
#     tokens packed a step: bf16, then FP8 with each of RUNS (below; the torch backend is
#     `torch:custom_fp8_cached_compile_torch`), on one DeepGEMM cache;
#  2. (SKIP_HOST=1 skips it) kernels_bench.py fp8_host at M = 2,048 (a pass of RL rows is a few
#     thousand tokens): each piece of an FP8 linear (eager, compiled with a symbolic row count, the
#     backward's operator and its parts) on deep_gemm and torch, host time beside GPU time.
# Longer than one device call: run detached (carry benchmarks/.whl, with the DeepGEMM tarball):
#   bash benchmarks/detached.sh start rows bash benchmarks/fp8_rows_gpu.sh && bash benchmarks/detached.sh follow rows 560
#   bash benchmarks/detached.sh follow rows 500          # the next call, within 30 s
set -uo pipefail
cd "$(dirname "$0")/.."
logs=${LOGS:-/tmp/detached/rows}
mkdir -p "$logs"
export PYTHONUNBUFFERED=1 DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-/tmp/dgjit}
nvidia-smi --query-gpu=name,clocks.sm,power.limit --format=csv,noheader
bash benchmarks/device_setup.sh > "$logs/setup.log" 2>&1 || { tail -5 "$logs/setup.log"; exit 1; }
dg=$(timeout 300 bash benchmarks/deepgemm_build.sh 2> "$logs/deepgemm_build.log") || { tail -20 "$logs/deepgemm_build.log"; exit 1; }
export PYTHONPATH=$dg${PYTHONPATH:+:$PYTHONPATH}
rm -f "$logs/setup.log" "$logs/deepgemm_build.log"  # a call brings back 8 files at most
# The FP8 GPU tests first (the two-stream backward and the weight cache on the real GEMMs).
timeout 600 python3 -m pytest -q -p no:cacheprovider -rs plugins/kernels/fp8/tests/test_gpu.py \
  plugins/kernels/fp8/tests/test_weight_cache.py > "$logs/tests.log" 2>&1
echo "fp8 GPU tests: exit $? $(grep -E '[0-9]+ (passed|failed|error)' "$logs/tests.log" | tail -1)"
profile() {  # NAME ARGS...
  local name=$1
  shift
  timeout 900 python3 benchmarks/trainer_memory.py profile --length variable --samples-per-rank 4 --seq-len 8192 \
    --warmup 5 --steps 10 --attn torch_fused --out "$logs/profile" "$@" > "$logs/run.log" 2>&1 || echo "$name: exit $?"
  { echo "=== $name: $*"; cat "$logs/run.log"; } >> "$logs/profiles.log"
  grep -E "rows: (first|GPU)" "$logs/run.log"
  rm -f "$logs/run.log"
}
profile bf16 --knob custom_compile_fused
# NAME:KNOB[:FLAG=on|off,...] (trainer_memory.py --fp8 FLAG=...): the defaults (two streams, W.T's
# blocks kept), stop 73's (W.T quantised every pass), and the backward on one stream in the graph.
for run in ${RUNS:-defaults:custom_fp8_cached_compile no_wt_cache:custom_fp8_cached_compile:transposed_cache=off one_stream:custom_fp8_cached_compile:overlap=off}; do
  IFS=: read -r name knob flags <<< "$run"
  extra=()
  for flag in ${flags//,/ }; do extra+=(--fp8 "$flag"); done
  profile "fp8_$name" --knob "$knob" "${extra[@]}"
done
if [ -z "${SKIP_HOST:-}" ]; then
  python3 benchmarks/kernels_bench.py fp8_host --host-m 2048 --backends deep_gemm torch --reps 200 \
    --out "$logs/kb" > "$logs/fp8_host.log" 2>&1 || echo "fp8_host: exit $?"
  python3 benchmarks/kernels_bench.py table --out "$logs/kb" 2>&1 | tail -45
fi
