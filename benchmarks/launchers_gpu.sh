#!/usr/bin/env bash
# Launchers on a GPU machine (issue 7's GPU checks), in one device call of a few minutes:
#   bash benchmarks/launchers_gpu.sh            (results: $OUT/launchers.tsv, logs in $OUT)
# 1. `prime sft` through the local launcher and through the torchrun launcher on 2 and 4 GPUs
#    (those the machine has), with nvidia-smi sampled during each run: the GPUs that held a
#    process of the run must be exactly the ones the placement gave it; per-rank logs checked
#    (logs/sft/rank_N.log, and logs/trainer/torchrun/node_0/ for torchrun).
# 2. The --dry-run placement of RL layouts on 4 and 8 GPUs (CUDA_VISIBLE_DEVICES set to the
#    layout's GPUs: a dry run starts nothing), read back from configs/plan.json.
# Installs prime first if this machine has not got it yet (benchmarks/device_setup.sh, carry
# benchmarks/.whl). Prints a short table at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/prime-launchers}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 CUDA_DEVICE_ORDER=PCI_BUS_ID  # CUDA numbers GPUs as nvidia-smi does
python3 -c "import prime_core, prime_plugin_local, prime_plugin_torchrun" 2>/dev/null || {
  bash benchmarks/device_setup.sh > "$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
}
prime() { python3 -m prime_core "$@"; }
ngpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
echo "GPUs visible: $ngpus" | tee "$OUT/summary.txt"
model=$OUT/model
[ -d "$model" ] || prime model tiny "$model" --hidden-size 512 --num-layers 8 --num-heads 8 --num-kv-heads 4 \
  --head-dim 64 > "$OUT/model.log" 2>&1
printf "check\tlauncher\tgpus\tplaced\tused (nvidia-smi)\tranks logged\tresult\n" > "$OUT/launchers.tsv"

# GPU indices holding a compute process whose command line mentions $1, sampled until $2 exits.
# Where nvidia-smi cannot show this container's PIDs, the GPUs whose used memory grew by more
# than 256 MiB over the idle baseline instead (the machine is otherwise idle).
sample_gpus() {
  local tag=$1 pid=$2 seen="" grew=""
  declare -A uuid2idx base
  while IFS=', ' read -r idx uuid; do uuid2idx[$uuid]=$idx; done < <(nvidia-smi --query-gpu=index,uuid --format=csv,noheader)
  while IFS=', ' read -r idx mem; do base[$idx]=$mem; done < <(nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits)
  while kill -0 "$pid" 2>/dev/null; do
    while IFS=', ' read -r p uuid; do
      [ -n "$p" ] || continue
      if tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null | grep -q -- "$tag"; then seen="$seen ${uuid2idx[$uuid]}"; fi
    done < <(nvidia-smi --query-compute-apps=pid,gpu_uuid --format=csv,noheader 2>/dev/null)
    while IFS=', ' read -r idx mem; do
      [ $((mem - ${base[$idx]:-0})) -gt 256 ] && grew="$grew $idx"
    done < <(nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits)
    sleep 0.5
  done
  [ -n "${seen// /}" ] || seen=$grew
  echo "$seen" | tr ' ' '\n' | grep -v '^$' | sort -un | paste -sd, -
}

sft_check() {  # sft_check LAUNCHER N
  local launcher=$1 n=$2 out=$OUT/sft-$1-$2
  [ "$ngpus" -ge "$n" ] || { printf "sft\t%s\t%s\t-\t-\t-\tskipped (%s GPUs)\n" "$launcher" "$n" "$ngpus" >> "$OUT/launchers.tsv"; return; }
  rm -rf "$out"
  local visible; visible=$(seq -s, 0 $((n - 1)))
  CUDA_VISIBLE_DEVICES=$visible timeout 300 python3 -m prime_core sft --model.name "$model" --model.impl hf \
    --data.type fake --data.batch-size 16 --seq-len 1024 --max-steps 40 --deployment.num-gpus "$n" \
    --launcher "$launcher" --output-dir "$out" > "$out.log" 2>&1 &
  local pid=$!
  local used; used=$(sample_gpus "$out/configs/sft.json" "$pid")
  wait "$pid"; local rc=$?
  local placed; placed=$(python3 -c "import json,sys; p=json.load(open('$out/configs/plan.json')); print(p['processes'][0]['env'].get('CUDA_VISIBLE_DEVICES','-'))" 2>/dev/null)
  local ranks; ranks=$(ls "$out/logs/sft" 2>/dev/null | grep -c '^rank_')
  if [ "$launcher" = torchrun ]; then
    local tr; tr=$(find "$out/logs/trainer/torchrun" -name stdout.log 2>/dev/null | wc -l); ranks="$ranks (+$tr torchrun)"
  fi
  local result=ok
  [ "$rc" = 0 ] || result="exit $rc (see $out.log)"
  [ "$result" = ok ] && [ "$used" != "$placed" ] && result="GPUs differ"
  printf "sft\t%s\t%s\t%s\t%s\t%s\t%s\n" "$launcher" "$n" "$placed" "${used:--}" "$ranks" "$result" >> "$OUT/launchers.tsv"
}

for n in 2 4; do sft_check local "$n"; sft_check torchrun "$n"; done

placement() {  # placement NAME VISIBLE ARGS...
  local name=$1 visible=$2; shift 2
  local out=$OUT/rl-$name
  rm -rf "$out"
  CUDA_VISIBLE_DEVICES=$visible prime run examples/cpu/rl.toml --model.name "$model" --output-dir "$out" "$@" \
    --dry-run > "$out.log" 2>&1
  local rc=$?
  local placed; placed=$(python3 - "$out/configs/plan.json" <<'EOF' 2>/dev/null
import json, sys
plan = json.load(open(sys.argv[1]))
print(" ".join(f"{p['role']}={p['env'].get('CUDA_VISIBLE_DEVICES', '-')}" for p in plan["processes"]))
EOF
)
  printf "rl-dry-run\t%s\t%s\t%s\t-\t-\t%s\n" "$name" "$(echo "$visible" | tr ',' '\n' | wc -l)" "${placed:--}" \
    "$([ $rc = 0 ] && echo ok || echo "exit $rc (see $out.log)")" >> "$OUT/launchers.tsv"
}
placement 4gpu-1+3 0,1,2,3 --deployment.num-infer-gpus 1 --deployment.num-train-gpus 3
placement 4gpu-2dp+2 0,1,2,3 --deployment.num-infer-gpus 2 --deployment.num-train-gpus 2 --inference.parallel.dp 2
placement 8gpu-6dp+2 0,1,2,3,4,5,6,7 --deployment.num-infer-gpus 6 --deployment.num-train-gpus 2 --inference.parallel.dp 6
placement 8gpu-tp2dp2+4 0,1,2,3,4,5,6,7 --deployment.num-infer-gpus 4 --deployment.num-train-gpus 4 \
  --inference.parallel.tp 2 --inference.parallel.dp 2
placement side-by-side-exp2 2,3 --inference.server.port 8001 --orchestrator.client.base-url http://localhost:8001/v1
placement torchrun-4gpu 0,1,2,3 --launcher torchrun --deployment.num-infer-gpus 2 --deployment.num-train-gpus 2 \
  --inference.parallel.dp 2

column -t -s $'\t' "$OUT/launchers.tsv" | tee -a "$OUT/summary.txt"
