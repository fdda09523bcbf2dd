#!/usr/bin/env bash
# The 1.7B shape's longest step on one H200 (issue 20's 1,048,576 tokens), which runs longer than
# one device call: it is started in a session of its own (benchmarks/detached.sh) and followed.
#
#   call 1: mv .fa4/p00 /tmp/p00                     carry .fa4/p00 (flash-attention 4, fetch_fa4.sh)
#   call 2: bash benchmarks/longest_gpu.sh           carry .fa4/p01 .fa4/whl benchmarks/.whl
#   then:   bash benchmarks/detached.sh follow longest 580     (each within 30 s of the call before)
#
# Call 2 installs, runs TESTS (pytest arguments, if set), times attention alone at TOKENS (one
# sample) in torch_fused (cuDNN) and flash_attention_4, comparing their outputs and gradients,
# and picks flash_attention_4 if it ran, agreed (||a - b|| / ||b|| under 2%) and was faster. Then it
# starts trainer_memory.py's KNOB at 8,192 and 16,384 tokens (they compile the blocks) and TOKENS,
# one step each, and follows it until the call's BUDGET seconds are nearly spent.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?run on the device machine (OUT is its output folder)}"
TOKENS=${TOKENS:-1048576}
KNOB=${KNOB:-custom_ac_chunk_offload}
BUDGET=${BUDGET:-585}
[ -f /tmp/p00 ] && { bash benchmarks/fa4_install.sh || echo "longest_gpu: flash-attention 4 not installed"; }
bash benchmarks/device_setup.sh > "$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 PYTHONUNBUFFERED=1
if [ -n "${TESTS:-}" ]; then
  # shellcheck disable=SC2086
  python3 -m pytest -q -p no:cacheprovider $TESTS > "$OUT/tests.log" 2>&1 || true
  tail -4 "$OUT/tests.log"
fi
python3 benchmarks/attention_bench.py --tokens "$TOKENS" --samples 1 --kernels torch_fused flash_attention_4 \
  --repeats 1 --out "$OUT" | tail -3
attn=$(python3 - "$OUT/attention.jsonl" <<'PY'
import json, sys
rows = {r["kernel"]: r for r in map(json.loads, open(sys.argv[1]))}
fa4, cudnn = rows.get("flash_attention_4", {}), rows.get("torch_fused", {})
ok = "ms" in fa4 and ("ms" not in cudnn or (fa4["rel_diff_vs_first"] < 0.02 and fa4["ms"] < cudnn["ms"]))
print("flash_attention_4" if ok else "torch_fused")
PY
)
echo "longest_gpu: attn = $attn"
mkdir -p /tmp/detached/longest/out
bash benchmarks/detached.sh start longest python3 benchmarks/trainer_memory.py knobs --kind longest --knobs "$KNOB" \
  --attn "$attn" --seq-lens 8192 16384 "$TOKENS" --warmup 0 --steps 1 --out /tmp/detached/longest/out
bash benchmarks/detached.sh follow longest $((BUDGET - SECONDS))
