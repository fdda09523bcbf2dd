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
