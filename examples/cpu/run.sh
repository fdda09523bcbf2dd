#!/usr/bin/env bash
# The CPU example, end to end: build a tiny model, warm it up with SFT, then RL with vLLM.
#   bash examples/cpu/run.sh                                   # outputs under outputs/cpu
#   OUT=/tmp/x SFT_STEPS=60 RL_STEPS=10 bash examples/cpu/run.sh   # shorter
# Extra arguments go to the RL run, e.g. --inference.server.port 8100.
# It rebuilds its own outputs under $OUT each time (base model, SFT model, RL run).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../.."
prime=${PRIME:-.venv/bin/prime}
python=${PYTHON:-.venv/bin/python}
out=${OUT:-outputs/cpu}
export HF_HUB_OFFLINE=1
start=$(date +%s)

rm -rf "$out/base" "$out/sft"
"$prime" model tiny "$out/base" --hidden-size 128 --num-layers 2
"$prime" envs sft-data arithmetic "$out/sft.jsonl" --n 8000 --args '{"digits": 1}'
"$prime" sft "$here/sft.toml" --output-dir "$out/sft" --model.name "$out/base" --data.path "$out/sft.jsonl" \
  --max-steps "${SFT_STEPS:-300}"
sft_done=$(date +%s)
"$prime" run "$here/rl.toml" --output-dir "$out/rl" --model.name "$out/sft/model" --max-steps "${RL_STEPS:-60}" \
  --clean "$@"
end=$(date +%s)

"$python" - "$out/rl/metrics.jsonl" "$((sft_done - start))" "$((end - sft_done))" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
rewards = [r["reward"] for r in rows if r.get("role") == "orchestrator"]
k = max(1, min(10, len(rewards) // 4))
first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
print(f"reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f} ({len(rewards)} steps)")
print(f"wall time: model + SFT {sys.argv[2]} s, RL {sys.argv[3]} s")
PY
