#!/usr/bin/env bash
# On the lent GPU machine: a command that runs longer than one device call (at most 600 s), in a
# process session of its own, which the device keeps running until the machine goes back
# (device README: a call's other processes are killed when it returns). Later calls follow it;
# each must come within the machine's idle release (30 s) of the call before.
#
#   bash benchmarks/detached.sh start NAME CMD [ARG...]   # start CMD; its output goes to /tmp/detached/NAME/log
#   bash benchmarks/detached.sh follow NAME SECONDS       # print the log as it grows, until CMD ends or
#                                                         # SECONDS pass; then copy /tmp/detached/NAME to $OUT/NAME
#
# follow exits with CMD's status once it has ended, and with 75 while it still runs. CMD can write
# files under /tmp/detached/NAME (its own $OUT is emptied before every call).
set -uo pipefail
action=${1:?start or follow}
name=${2:?a name}
dir=/tmp/detached/$name
case "$action" in
  start)
    shift 2
    [ $# -gt 0 ] || { echo "detached.sh start $name: no command" >&2; exit 2; }
    [ -e "$dir/pid" ] && { echo "detached.sh start $name: already started ($dir)" >&2; exit 2; }
    mkdir -p "$dir"
    setsid bash -c 'echo $$ > "$1/pid"; shift; "$@" > "$0/log" 2>&1; echo $? > "$0/rc"' "$dir" "$dir" "$@" \
      < /dev/null > /dev/null 2>&1 &
    for _ in $(seq 50); do [ -s "$dir/pid" ] && break; sleep 0.1; done
    echo "detached.sh: $name started (pid $(cat "$dir/pid")), log $dir/log"
    ;;
  follow)
    seconds=${3:?seconds}
    [ -d "$dir" ] || { echo "detached.sh follow $name: nothing started ($dir)" >&2; exit 2; }
    end=$((SECONDS + seconds))
    tail -n +1 -F "$dir/log" 2>/dev/null &
    tailer=$!
    while [ ! -e "$dir/rc" ] && [ $SECONDS -lt $end ]; do sleep 2; done
    sleep 1
    kill $tailer 2>/dev/null
    wait $tailer 2>/dev/null
    [ -n "${OUT:-}" ] && mkdir -p "$OUT/$name" && cp -r "$dir"/. "$OUT/$name"/
    if [ -e "$dir/rc" ]; then
      rc=$(cat "$dir/rc")
      echo "detached.sh: $name ended with status $rc"
      exit "$rc"
    fi
    echo "detached.sh: $name still running after ${seconds} s"
    exit 75
    ;;
  *) echo "detached.sh: start or follow, not $action" >&2; exit 2 ;;
esac
