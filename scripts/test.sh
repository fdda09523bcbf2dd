#!/usr/bin/env bash
# The whole test suite, as CI runs it (README, "Test"), in two pytest runs:
#   1. the tests not marked `serial`, in two pytest-xdist workers, a module to a worker
#      (`--dist loadfile`: a module's fixtures start once), each process with one OpenMP thread;
#   2. the `serial` ones (runs with real vLLM servers), one at a time, with every core.
# Much of run 1 waits on one core (imports, subprocesses starting, servers answering), so two
# workers fill the 2 cores that one leaves half idle. One thread a process, because two
# processes of two OpenMP threads on 2 cores slowed each other 4.6x (the tool warm-up's SFT
# step: 0.38 s alone, 1.73 s beside a second one; one thread each: 0.70 s; OMP_WAIT_POLICY=
# PASSIVE: 0.73 s even alone).
# Arguments go to both runs:
#   bash scripts/test.sh
#   bash scripts/test.sh -x tests/test_sft.py
# WORKERS=N: run 1's workers (1: no xdist, and the threads are left alone).
# With no test paths given, the tool example's SFT warm-up (tests/test_agentic_e2e.py's model,
# about 4 minutes of run 2 otherwise) starts in the background at the lowest priority, in one
# thread, so it takes the cores only when the tests leave them idle: about 4% of run 1, a quarter
# of run 2 (real vLLM servers answering). Its module runs last in run 2 (marker `last`), and its
# fixture waits for it (PRIME_TOOL_WARMUP). It is stopped and removed when this script exits.
# One thread, though the suite ends with about 100 s of that wait on one core: with two (0.50 s a
# step against 0.76 on an idle machine) it made 9 steps in run 1 and about 3 a minute in run 2,
# where idle moments seldom come on both cores at once (stop 65), so the wait would have grown.
# PRIME_TOOL_WARMUP=off: the fixture builds the model itself.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
for arg in "$@"; do
  case "$arg" in
    -m|-m*) echo "scripts/test.sh: it selects by marker itself (-m \"not serial\", then -m serial); for your own" \
              "-m, run pytest directly: $python -m pytest $*" >&2; exit 2 ;;
  esac
done
workers=${WORKERS:-2}
paths=0
for arg in "$@"; do [ -e "${arg%%::*}" ] && paths=1; done
if [ "$paths" = 0 ] && [ -z "${PRIME_TOOL_WARMUP:-}" ]; then
  warm=$(mktemp -d "${TMPDIR:-/tmp}/prime-tool-warmup.XXXXXX")
  # setsid: a process group of its own, which the trap below stops (the SFT run included); and it
  # stops itself if this script is gone (killed with SIGKILL, where no trap runs).
  OMP_NUM_THREADS=1 OUT="$warm" WARM_ONLY=1 SFT_STEPS="${PRIME_TOOL_SFT_STEPS:-500}" PYTHON="$python" \
    PRIME="$(dirname "$python")/prime" setsid nice -n 19 bash -c '
      # A session of its own is an autogroup of its own, which the scheduler weighs against the
      # tests as an equal unless the group nice is raised too (sched(7), "autogroup"): without
      # this line the first run took 1,270 s instead of 1,073.
      echo 19 > /proc/self/autogroup 2> /dev/null
      bash examples/tools/run.sh > "$OUT/log" 2>&1 & child=$!
      while kill -0 "$child" 2>/dev/null; do
        kill -0 "$0" 2>/dev/null || kill -- -$$
        sleep 2
      done
      wait "$child"; echo $? > "$OUT/rc"' $$ &
  warm_pid=$!
  trap 'kill -- -"$warm_pid" 2>/dev/null; wait "$warm_pid" 2>/dev/null; rm -rf "$warm"' EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  export PRIME_TOOL_WARMUP="$warm"
fi
if [ "$workers" = 1 ]; then
  "$python" -m pytest -m "not serial" "$@"
else
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$python" -m pytest -n "$workers" --dist loadfile -m "not serial" "$@"
fi
first=$?
"$python" -m pytest -m serial "$@"
second=$?
# 5: a run that collected nothing (e.g. a file holding only one kind of test); fine if the other ran.
if [ "$first" = 5 ] && [ "$second" = 5 ]; then exit 5; fi
[ "$first" = 5 ] && first=0
[ "$second" = 5 ] && second=0
exit $((first > second ? first : second))
