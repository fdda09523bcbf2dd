#!/usr/bin/env bash
# prime sft with impl = "hf" on one GPU, one packed row per pass against rows stacked into
# passes of pass_tokens tokens (trainer.model.pass_tokens), side by side in one job: a random
# model (hidden 1024, 8 layers, byte-level vocabulary), bf16, fake variable-length samples, 128
# a step, 12 steps; the median tokens/s of steps 5-12 and the first and last losses per run.
#
#   bash benchmarks/fetch_device_wheels.sh                       # here, once
#   run(command="OUT=$OUT bash benchmarks/stacked_rows_gpu.sh", carry=["benchmarks/.whl"])
#   SEQS="512 2048" PTS="1 2048 4096 16384" ...                 # the shapes (these are the defaults)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
bash benchmarks/device_setup.sh > "$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
export HF_HUB_OFFLINE=1
work=$(mktemp -d)
python3 -m prime_core model tiny "$work/model" --hidden-size 1024 --num-layers 8 > "$OUT/model.log" 2>&1
for seq in ${SEQS:-512 2048}; do
  for pt in ${PTS:-1 2048 4096 16384}; do
    run="$work/sft_${seq}_${pt}"
    python3 -m prime_core sft --model.name "$work/model" --model.impl hf --model.dtype bfloat16 --data.type fake \
      --data.length variable --seq-len "$seq" --data.batch-size 128 --max-steps 12 --model.pass-tokens "$pt" \
      --output-dir "$run" > "$OUT/sft_${seq}_${pt}.log" 2>&1 || { echo "sft seq_len $seq pass_tokens $pt failed"; continue; }
    python3 - "$run/metrics.jsonl" "$seq" "$pt" <<'PY'
import json, statistics, sys
rows = [r for r in map(json.loads, filter(str.strip, open(sys.argv[1]))) if r.get("role") == "sft"]
print(f"seq_len {sys.argv[2]:>5}  pass_tokens {sys.argv[3]:>6}: "
      f"{statistics.median(r['tokens_per_s'] for r in rows[4:]):>9,.0f} tok/s, "
      f"loss {rows[0]['loss']:.5f} -> {rows[-1]['loss']:.5f}")
PY
  done
done
nvidia-smi --query-gpu=name --format=csv,noheader
