#!/usr/bin/env bash
# The tool-use example, end to end: a tiny model, an SFT warm-up that shows it both ways of
# answering (calling the calculator, and answering directly), then RL with vLLM on the
# calculator environment, where only the tool gets three-digit sums right.
#   bash examples/tools/run.sh                                      # outputs under outputs/tools
#   OUT=/tmp/x RL_STEPS=20 bash examples/tools/run.sh               # shorter RL (the warm-up needs its 500 steps)
#   OUT=/tmp/x WARM_ONLY=1 bash examples/tools/run.sh               # the warm model only ($OUT/sft/model)
# Extra arguments go to the RL run, e.g. --inference.server.port 8100.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../.."
prime=${PRIME:-.venv/bin/prime}
python=${PYTHON:-.venv/bin/python}
out=${OUT:-outputs/tools}
export HF_HUB_OFFLINE=1
start=$(date +%s)

rm -rf "$out/base" "$out/sft"
"$prime" model tiny "$out/base" --hidden-size 128 --num-layers 2
# 30% of the examples call the tool (call, result, answer); the rest answer directly.
"$prime" envs sft-data calculator "$out/sft.jsonl" --n 8000 --demos "${DEMOS:-0.3}" --args '{"digits": 3}'
"$prime" sft "$here/../cpu/sft.toml" --output-dir "$out/sft" --model.name "$out/base" --data.path "$out/sft.jsonl" \
  --seq-len 256 --max-steps "${SFT_STEPS:-500}"  # rows of 256 tokens: the samples are at most 194
sft_done=$(date +%s)
[ "${WARM_ONLY:-0}" = 1 ] && exit 0
"$prime" run "$here/rl.toml" --output-dir "$out/rl" --model.name "$out/sft/model" --max-steps "${RL_STEPS:-40}" \
  --clean "$@"
end=$(date +%s)
"$python" "$here/report.py" "$out/rl" --sft-seconds "$((sft_done - start))" --rl-seconds "$((end - sft_done))"
