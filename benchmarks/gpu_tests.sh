#!/usr/bin/env bash
# Every GPU test on one lent GPU, as a regression sweep of the head: the tests marked `gpu`
# (pytest -m gpu, all of tests/ and plugins/; the multi-GPU ones skip with the count they need)
# and the Triton kernels' tests compiled (the files that CI runs in Triton's interpreter); liger's
# too, with liger-kernel from benchmarks/.whl/extras (fetch_device_wheels.sh). With
# benchmarks/.whl/deepgemm-src.tar.gz carried, DeepGEMM is built first so the FP8 tests run on it
# too. About 8 minutes on an H200. Stop 65: with DeepGEMM, 75 passed and 39 skipped in 387 s;
# without it, 70 passed and 44 skipped in 269 s; the compiled Triton tests, 109 passed in 65-76 s.
# That is longer than one device call, so run it detached (carry benchmarks/.whl):
#   mkdir -p /tmp/detached/gpu && bash benchmarks/detached.sh start gpu bash benchmarks/gpu_tests.sh \
#     && bash benchmarks/detached.sh follow gpu 560        # then, in the next call: follow gpu 300
# Logs go to $LOGS (default /tmp/detached/gpu, which follow copies to $OUT/gpu). Exit status: the
# first failing run's.
set -uo pipefail
cd "$(dirname "$0")/.."
logs=${LOGS:-/tmp/detached/gpu}
mkdir -p "$logs"
bash benchmarks/device_setup.sh > "$logs/setup.log" 2>&1 || { tail -5 "$logs/setup.log"; exit 1; }
tail -1 "$logs/setup.log" | cut -c1-100
if [ -f benchmarks/.whl/deepgemm-src.tar.gz ]; then
  export DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-/tmp/dgjit}
  if dg=$(timeout 300 bash benchmarks/deepgemm_build.sh 2> "$logs/deepgemm_build.log"); then
    export PYTHONPATH=$dg${PYTHONPATH:+:$PYTHONPATH}
    echo "gpu_tests: DeepGEMM from $dg"
  else
    echo "gpu_tests: DeepGEMM did not build (log: $logs/deepgemm_build.log); its tests will skip"
  fi
fi
status=0
run() {  # NAME ARGS...: one pytest run, its log and its summary
  local name=$1 start rc
  shift
  start=$(date +%s)
  timeout 1500 python3 -m pytest -q -p no:cacheprovider -rs --durations=10 "$@" > "$logs/$name.log" 2>&1
  rc=$?
  echo "gpu_tests: $name: exit $rc in $(( $(date +%s) - start )) s:" \
    "$(grep -E '[0-9]+ (passed|failed|error)' "$logs/$name.log" | tail -1)"
  [ "$status" = 0 ] && status=$rc
}
run gpu_marked -m gpu tests plugins
# The files whose kernels CI checks in the interpreter (prime_core.testing.triton.interpreter_rerun).
mapfile -t triton < <(grep -rl --include='*.py' interpreter_rerun tests plugins | sort)
run triton_compiled "${triton[@]}"
grep -h "^SKIPPED" "$logs/gpu_marked.log" | sort -u
exit "$status"
