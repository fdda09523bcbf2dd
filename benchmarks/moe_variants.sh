#!/usr/bin/env bash
# The 2.9B MoE step (RECIPE, default fast-bf16; 8k tokens; STEPS timed, default 8) once per NAME=DIR of VARIANTS,
# DIR first on PYTHONPATH ("now": nothing added), side by side in one job. The editable prime_core is not
# shadowed this way; plugin packages are. E.g. VARIANTS="base=benchmarks/.whl/baseline now=now".
# LOOPS="step pipelined": each variant in both step loops (parallel_bench.py --pipelined).
# ROUTINGS="random balanced": each on the random weights' collapsed routing and on an even one (--routing).
# ATTNS="auto flash_attention_4": each with the recipe's attention kernel (auto) and with these (--attn).
# LENGTH=variable SAMPLES=4: each step's samples of 8 to 8,192 tokens, packed into rows (--length, an RL step).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/prime-variants}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -c "import prime_core, prime_plugin_cp" 2>/dev/null || bash benchmarks/device_setup.sh > "$OUT/setup.log" 2>&1
for routing in ${ROUTINGS:-random}; do
  for item in $VARIANTS; do
   for attn in ${ATTNS:-auto}; do
    for loop in ${LOOPS:-step}; do  # step: read each step before the next (prime trainer); pipelined: prime sft's
      name=${item%%=*}; dir=${item#*=}; [ "$loop" = step ] || name=$name-$loop
      [ "$routing" = random ] || name=$name-$routing; [ "$attn" = auto ] || name=$name-$attn; mkdir -p "$OUT/$name"
      # the variant's folder goes first on the PYTHONPATH the job already has (packages carried to /tmp, say)
      first=$([ "$dir" = now ] || realpath "$dir")
      PYTHONPATH=$(printf '%s\n' "$first" "${PYTHONPATH:-}" | grep . | paste -sd:) timeout 200 python3 -m \
        torch.distributed.run --standalone --nproc-per-node 1 benchmarks/parallel_bench.py moe --ep 1 \
        --recipe ${RECIPE:-fast-bf16} --seq-lens 8192 --samples-per-group ${SAMPLES:-1} --length ${LENGTH:-fixed} \
        --warmup ${WARMUP:-1} --steps ${STEPS:-8} \
        $([ "$loop" = step ] || echo --pipelined) $([ "$attn" = auto ] || echo --attn "$attn") \
        --routing "$routing" --out "$OUT/$name" > "$OUT/$name.log" 2>&1 || echo "$name exited $?"
      echo "$name: $(grep -E '^moe ' "$OUT/$name.log")"
      grep -m1 "routing:" "$OUT/$name.log"
      # every run's result rows in one file, each with its variant's name (few files come back from a device call)
      [ -f "$OUT/$name/parallel.jsonl" ] && python3 -c "import json,sys; [print(json.dumps({**json.loads(l), 'variant': sys.argv[1]})) for l in open(sys.argv[2])]" \
        "$name" "$OUT/$name/parallel.jsonl" >> "$OUT/rows.jsonl" && rm -r "$OUT/$name"
    done
   done
  done
done
