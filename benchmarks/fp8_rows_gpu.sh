#!/usr/bin/env bash
# One GPU with DeepGEMM: where the FP8 step's time goes over an RL step's rows, in one job. STEPS
# (default "host profiles"; any order, any subset):
#   tests     the FP8 GPU tests (test_gpu.py, test_weight_cache.py; 270 s on an H100 in stop 74,
#             most of it DeepGEMM compiling kernels) and the fused update's (fsdp's test_adamw.py,
#             the grouped norm launches among them: run it before timing grouped_norms=on);
#   host      kernels_bench.py fp8_host at M = 2,048 (a pass of RL rows is a few thousand tokens) on
#             deep_gemm and torch: each piece of an FP8 linear (eager, compiled with a symbolic row
#             count, the backward's operator and its parts, DeepGEMM's call alone), host time
#             beside GPU time;
#   profiles  trainer_memory.py profile --length variable, compiled 1.7B, `torch_fused`, 4 samples
#             of 8-8,192 tokens packed a step: bf16, then FP8 with each of RUNS (below), on one
#             DeepGEMM cache (the first FP8 run compiles its kernels: 250 s of its first pass in
#             stop 74).
# Longer than one device call (the defaults: about 22 minutes, estimated from stop 74's H100 job, where
# setup took 2, the tests 4.5, bf16's profile 2.5 and the first FP8 one 6.5): run detached (carry
# benchmarks/.whl, with the DeepGEMM tarball), following it in calls that each start within 30 s of
# the last:
#   bash benchmarks/detached.sh start rows bash benchmarks/fp8_rows_gpu.sh && bash benchmarks/detached.sh follow rows 560
#   bash benchmarks/detached.sh follow rows 580          # the next calls
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
tests() {
  timeout 600 python3 -m pytest -q -p no:cacheprovider -rs plugins/kernels/fp8/tests/test_gpu.py \
    plugins/kernels/fp8/tests/test_weight_cache.py plugins/parallel/fsdp/tests/test_adamw.py > "$logs/tests.log" 2>&1
  echo "GPU tests: exit $? $(grep -E '[0-9]+ (passed|failed|error)' "$logs/tests.log" | tail -1)"
}
host() {
  python3 benchmarks/kernels_bench.py fp8_host --host-m 2048 --backends deep_gemm torch --reps 200 \
    --out "$logs/kb" > "$logs/fp8_host.log" 2>&1 || echo "fp8_host: exit $?"
  python3 benchmarks/kernels_bench.py table --out "$logs/kb" 2>&1 | tail -60
}
profile() {  # NAME ARGS...
  local name=$1
  shift
  timeout 900 python3 benchmarks/trainer_memory.py profile --length variable --samples-per-rank 4 --seq-len 8192 \
    --warmup 5 --steps 10 --attn torch_fused --out "$logs/profile" "$@" > "$logs/run.log" 2>&1 || echo "$name: exit $?"
  { echo "=== $name: $*"; cat "$logs/run.log"; } >> "$logs/profiles.log"
  grep -E "rows: (first|GPU)" "$logs/run.log"
  rm -f "$logs/run.log"
}
# RUNS: NAME:KNOB[:FLAG,...], a FLAG one of SWITCH=on|off (trainer_memory.py --set), attn=KERNEL (in
# place of torch_fused) or gc=off (trainer_memory.py --gc off): the defaults (two streams, W.T's blocks kept), the torch backend, the backward
# on one stream in the graph, and W.T quantised every pass (stop 73's cache). Without cuDNN's
# attention, for stop 74's lead: RUNS="flash:custom_fp8_cached_compile:attn=torch_flash"; without the
# garbage collector in the timed steps: RUNS="nogc:custom_fp8_cached_compile:gc=off"; the gradient
# norm's squares launched a group at a time: RUNS="grouped:custom_fp8_cached_compile:grouped_norms=on".
profiles() {
  profile bf16 --knob custom_compile_fused
  local run name knob flags
  for run in ${RUNS:-defaults:custom_fp8_cached_compile torch:custom_fp8_cached_compile_torch \
                     one_stream:custom_fp8_cached_compile:overlap=off \
                     no_wt_cache:custom_fp8_cached_compile:transposed_cache=off}; do
    IFS=: read -r name knob flags <<< "$run"
    local extra=()
    for flag in ${flags//,/ }; do
      case "$flag" in
        attn=*) extra+=(--attn "${flag#attn=}") ;;
        gc=*) extra+=(--gc "${flag#gc=}") ;;
        *) extra+=(--set "$flag") ;;
      esac
    done
    profile "$name" --knob "$knob" "${extra[@]}"
  done
}
for step in ${STEPS:-host profiles}; do
  case "$step" in
    tests|host|profiles) "$step" ;;
    *) echo "fp8_rows_gpu: unknown step $step (tests, host, profiles)"; exit 2 ;;
  esac
done
