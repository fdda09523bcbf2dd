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

"$python" - "$out" "$((sft_done - start))" "$((end - sft_done))" <<'PY'
import json, sys
from pathlib import Path
from prime_core.orchestrator.env import Task
from prime_core.orchestrator.expected import expected_exact_match
from prime_core.weights import versions
from prime_plugin_tasks.arithmetic import SYSTEM as system
out = Path(sys.argv[1])
rows = [json.loads(l) for l in open(out / "rl" / "metrics.jsonl") if l.strip()]
rewards = [r["reward"] for r in rows if r.get("role") == "orchestrator"]
k = max(1, min(10, len(rewards) // 4))
first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
print(f"sampled reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f} ({len(rewards)} steps)")
sums = [Task(prompt=[{"role": "system", "content": system}, {"role": "user", "content": f"{a}+{b}"}],
             answer=str(a + b)) for a in range(10) for b in range(10)]
final = versions(out / "rl" / "weights")[-1][1]
before = expected_exact_match(out / "sft" / "model", sums)
after = expected_exact_match(final, sums, tokenizer_path=out / "sft" / "model")
print(f"expected reward on all 100 sums: after SFT {before:.3f} -> after RL {after:.3f}")
print(f"wall time: model + SFT {sys.argv[2]} s, RL {sys.argv[3]} s")
PY

# The run's curves (reward, loss, entropy, mismatch KL, throughput, ...) as a PNG, with a summary.
if "$prime" report --help >/dev/null 2>&1; then
  "$prime" report "$out/rl"
else
  echo "plots: pip install prime-plugin-report, then: prime report $out/rl"
fi
