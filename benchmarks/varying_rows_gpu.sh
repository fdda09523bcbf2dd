#!/usr/bin/env bash
# Compiled steps over an RL step's rows on one GPU: each step 4 samples of 8 to 8,192 tokens, packed
# into rows (--length variable), 5 warm-up and 8 timed steps (WARMUP, STEPS), each pair of runs side by side
# in this job (VARIANTS: the MoE runs' NAME=DIR plugin copies, as moe_variants.sh takes them):
#   dense 1.7B, fp32 master weights: attn auto (flash-attention 4 where it is installed) | torch_fused
#   dense 1.7B, torch_fused: bf16 | FP8 (the fp8 defaults; DeepGEMM where it is on PYTHONPATH)
#   MoE 2.9B, bf16 weights: attn auto | torch_fused
# TORCH_LOGS=recompiles: every log names each graph compiled after a frame's first; the table at the
# end counts them, and any run that hit dynamo's recompile limit (after which its blocks run eagerly).
#   bash benchmarks/fa4_install.sh; export PYTHONPATH=$(bash benchmarks/deepgemm_build.sh)
#   OUT=$OUT bash benchmarks/varying_rows_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/prime-varying}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_LOGS=recompiles NCCL_NVLS_ENABLE=0
python3 -c "import prime_core, prime_plugin_cp" 2>/dev/null || bash benchmarks/device_setup.sh > "$OUT/setup.log" 2>&1
rows=(--length variable --samples-per-rank 4 --seq-lens 8192 --warmup "${WARMUP:-5}" --steps "${STEPS:-8}")
python3 benchmarks/trainer_memory.py knobs --knobs fast_defaults "${rows[@]}" --out "$OUT/dense"
python3 benchmarks/trainer_memory.py knobs --knobs fast_defaults custom_compile_fused custom_fp8_cached_compile \
  --attn torch_fused "${rows[@]}" --out "$OUT/dense"
OUT=$OUT/moe VARIANTS=${VARIANTS:-now=now} ATTNS="auto torch_fused" LENGTH=variable SAMPLES=4 WARMUP=${WARMUP:-5} \
  STEPS=${STEPS:-8} bash benchmarks/moe_variants.sh
python3 - "$OUT" <<'EOF'
import json, pathlib, re, sys
out = pathlib.Path(sys.argv[1])
rows = [json.loads(l) for f in (out / "dense/results.jsonl", out / "moe/rows.jsonl") if f.exists() for l in open(f)]
logs = sorted((out / "dense").glob("*.log")) + sorted((out / "moe").glob("*.log"))
print(f"{'log':48} {'recompiles':>10} {'limit hit':>9}")
for log in logs:
    text = log.read_text(errors="replace")
    print(f"{log.parent.name + '/' + log.name:48} {len(re.findall('Recompiling function', text)):>10} "
          f"{'yes' if 'recompile_limit' in text else 'no':>9}")
# the mean holds each step's compiles; the median step mostly does not
print(f"{'run':48} {'tok/s':>8} {'MFU %':>6} {'median s':>8} {'max s':>6} {'peak GiB':>8}")
for r in rows:
    name = "/".join(str(r[k]) for k in ("model", "config", "attn", "variant") if r.get(k))
    print(f"{name:48} {r.get('tokens_per_s', 0):>8,.0f} {100 * r.get('mfu', 0):>6.1f} "
          f"{r.get('step_time_median_s', 0):>8.3f} {max(r.get('step_times_s', [0])):>6.2f} {r.get('peak_memory_gib', 0):>8.1f}")
EOF
