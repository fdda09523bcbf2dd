#!/usr/bin/env bash
# Follow the logs of a prime SLURM job in tmux.
#
#   bash slurm_tmux.sh JOB_NAME OUTPUT_DIR
#
# Opens (or attaches to) the tmux session "slurm-JOB_NAME" with two windows:
#   0 Terminal: a plain shell
#   1 Logs: one pane per log stream, side by side: trainer (latest_train_node_rank_*.log),
#     orchestrator (latest_orchestrator.log), inference (latest_infer_node_rank_*.log).
# The panes follow every node rank and wait for the job to start. The streams come from
# OUTPUT_DIR/slurm/panes when the launcher wrote one (an SFT job has only the trainer).
set -euo pipefail
if [ $# -ne 2 ]; then
  echo "usage: bash $0 JOB_NAME OUTPUT_DIR" >&2
  exit 2
fi
job=$1
out=$(cd "$2" 2>/dev/null && pwd) || { echo "error: output dir $2 not found" >&2; exit 2; }
logs="$out/slurm"
session="slurm-$job"
command -v tmux >/dev/null || { echo "error: tmux not found: install it (apt-get install tmux)" >&2; exit 2; }

attach() {
  if [ -n "${TMUX:-}" ]; then tmux switch-client -t "$session"; else tmux attach-session -t "$session"; fi
}
if tmux has-session -t "=$session" 2>/dev/null; then
  attach
  exit 0
fi

patterns=()
if [ -f "$logs/panes" ]; then
  while IFS= read -r line; do [ -n "$line" ] && patterns+=("$line"); done < "$logs/panes"
else
  patterns=("latest_train_node_rank_*.log" "latest_orchestrator.log" "latest_infer_node_rank_*.log")
fi

# A pane's command: wait for the logs to appear, then follow them by name (a new job
# re-points the latest_* links; tail -F follows).
follow() {
  printf 'cd %q; echo "waiting for %s in %s"; until ls %s >/dev/null 2>&1; do sleep 2; done; exec tail -n 200 -F %s' \
    "$logs" "$1" "$logs" "$1" "$1"
}

tmux new-session -d -s "$session" -n Terminal -c "$out"
tmux new-window -t "$session" -n Logs -c "$logs" "$(follow "${patterns[0]}")"
for pattern in "${patterns[@]:1}"; do
  tmux split-window -h -t "$session:Logs" -c "$logs" "$(follow "$pattern")"
done
tmux select-layout -t "$session:Logs" even-horizontal
tmux select-window -t "$session:Logs"
if [ -z "${PRIME_TMUX_DETACHED:-}" ]; then attach; fi
