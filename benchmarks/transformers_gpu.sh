#!/usr/bin/env bash
# Issue 19's GPU work (the transformers inference backend), in phases that each fit one 10-minute
# device call (the machine has no vLLM; benchmarks/device_setup.sh installs prime first):
#   bash benchmarks/transformers_gpu.sh tests      # the backend's GPU tests, contract suite and engine tests
#   bash benchmarks/transformers_gpu.sh 0.6b-async 0.6b-sync 1.7b-async 1.7b-sync   # prime run, one GPU
#   bash benchmarks/transformers_gpu.sh variants   # the 0.6B server alone under several inference.args
#   bash benchmarks/transformers_gpu.sh publish-io # write + fsync time of each model built so far
#   bash benchmarks/transformers_gpu.sh table      # the table of everything under $OUT
# Each run phase is one `prime run` (transformers_rl_bench.py); GPUS=2 splits inference and trainer over two
# GPUs instead of sharing GPU 0. Results: $OUT/results.jsonl; each run's metrics and logs in $OUT/<shape>-async<k>/
# (models and checkpoints stay in /tmp: gigabytes).
# Knobs (environment): STEPS (10), BATCH (256 samples), MAX_TOKENS (256), UTIL (0.35 of the GPU for inference),
# ARGS (inference.args of the runs, JSON), TRANSPORT (weight_broadcast.type: filesystem, or ipc), VARIANTS ("LABEL JSON;LABEL JSON;..." for the variants phase).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/prime-transformers}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
bench() {  # bench SHAPE ASYNC_LEVEL
  timeout 580 python3 benchmarks/transformers_rl_bench.py --out "$OUT" --work /tmp/prime-transformers-runs \
    --models /tmp/prime-transformers-models --shapes "$1" --async-levels "$2" \
    --gpus "${GPUS:-1}" --steps "${STEPS:-10}" --batch-size "${BATCH:-256}" --max-tokens "${MAX_TOKENS:-256}" \
    --gpu-memory-utilization "${UTIL:-0.35}" --timeout 420 --weight-broadcast "${TRANSPORT:-filesystem}" \
    ${ARGS:+-- --inference.args "$ARGS"} \
    || echo "bench $1 async_level=$2 exited $?"
}
for phase in "$@"; do
  case "$phase" in
    tests)
      timeout 560 python3 -m pytest -q -p no:cacheprovider -rs -s plugins/inference/transformers/tests/test_gpu.py \
        plugins/inference/transformers/tests/test_shared_weights.py plugins/inference/transformers/tests/test_contract.py plugins/inference/transformers/tests/test_engine.py \
        > "$OUT/tests.log" 2>&1
      grep -i "mismatch KL" "$OUT/tests.log"; tail -15 "$OUT/tests.log" ;;
    0.6b-async) bench qwen3-0.6b 1 ;;
    0.6b-sync) bench qwen3-0.6b 0 ;;
    1.7b-async) bench qwen3-1.7b 1 ;;
    1.7b-sync) bench qwen3-1.7b 0 ;;
    variants)
      python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; \
from transformers_rl_bench import build_model; build_model(Path('/tmp/prime-transformers-models/qwen3-0.6b'), \
'qwen3-0.6b', 'bfloat16')"
      variant_args=()
      IFS=';' read -ra specs <<< "${VARIANTS:-sdpa {\}}"
      for spec in "${specs[@]}"; do variant_args+=(--variant "${spec%% *}" transformers "${spec#* }"); done
      timeout 560 python3 benchmarks/inference_backends_bench.py --model /tmp/prime-transformers-models/qwen3-0.6b \
        --dtype bfloat16 --gpu-memory-utilization "${UTIL:-0.35}" --concurrency ${CONCURRENCY:-256} --group 8 \
        --max-tokens "${MAX_TOKENS:-256}" --prompt-len 48 --max-model-len 2048 --repeats 1 \
        --work /tmp/prime-backends --out "$OUT/backends_gpu.jsonl" "${variant_args[@]}" \
        || echo "variants exited $?" ;;
    publish-io)  # what a filesystem publish costs here: writing each built model's tensors, then fsyncing them
      python3 - "$OUT" <<'PY' | tee "$OUT/publish_io.txt"
import os, sys, time
from pathlib import Path
from safetensors.torch import load_file, save_file
from prime_core.run_dir import fsync_tree
for model in sorted(Path("/tmp/prime-transformers-models").glob("*/model.safetensors")):
    tensors = {k: v.clone() for k, v in load_file(model).items()}
    size = sum(v.numel() * v.element_size() for v in tensors.values()) / 1e9
    folder = Path("/tmp/prime-publish-io") / model.parent.name
    folder.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter(); save_file(tensors, folder / "model.safetensors"); written = time.perf_counter()
    fsync_tree(folder); synced = time.perf_counter()
    print(f"{model.parent.name}: {size:.2f} GB written in {written - started:.2f} s, fsynced in {synced - written:.2f} s")
    # the same tensors through the filesystem transport's publish, profiled (twice: the second prunes nothing new)
    import cProfile, pstats
    from transformers import AutoModelForCausalLM
    from prime_core.weights import FilesystemPublisher
    with __import__("torch").device("meta"):
        shell = AutoModelForCausalLM.from_config(__import__("transformers").AutoConfig.from_pretrained(model.parent))
    publisher = FilesystemPublisher(output_dir=Path("/tmp/prime-publish-io") / f"{model.parent.name}-run")
    for step in (1, 2):
        profile = cProfile.Profile()
        started = time.perf_counter(); profile.enable(); publisher.publish(shell, step, tensors); profile.disable()
        print(f"{model.parent.name}: FilesystemPublisher.publish of step {step} in {time.perf_counter() - started:.2f} s")
    pstats.Stats(profile).sort_stats("cumulative").print_stats(14)
PY
      ;;
    table) python3 benchmarks/transformers_rl_bench.py table --out "$OUT" ;;
    *) echo "unknown phase $phase (tests, 0.6b-async, 0.6b-sync, 1.7b-async, 1.7b-sync, variants, publish-io, table)"
       exit 2 ;;
  esac
done
