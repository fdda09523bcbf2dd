"""The whole RL loop with the transformers inference backend: ``prime run`` end to end on one
GPU (inference and trainer sharing it) or two, asynchronous and synchronous, on Qwen3-shaped
random models with a locally built tokenizer and a procedural task.

For each shape it runs ``prime run`` twice, ``async_level = 1`` then ``0`` (the synchronous
baseline, same everything else), and prints per run: step time (the trainer's wall time per
step), trainer time (its forward, backward and optimizer step), inference time (the server's
busy time per batch of samples), samples/s and tokens/s of inference while busy, weight update
latency (the server's load, waiting for the model included; and from the trainer's publish to
the new weights served), the async overlap ratio ``step time / max(trainer time, inference
time)`` and steps per hour. The first ``--skip`` steps are start-up and left out. Results go
to ``OUT/results.jsonl``, each run's files to ``OUT/<shape>-async<k>/``.

    python3 benchmarks/transformers_rl_bench.py --out $OUT                       # one GPU, both shapes
    python3 benchmarks/transformers_rl_bench.py --out $OUT --shapes qwen3-1.7b --gpus 2
    python3 benchmarks/transformers_rl_bench.py --out $OUT --shapes qwen3-1.7b --gpus 4   # trainer on 3 GPUs
    python3 benchmarks/transformers_rl_bench.py --out $OUT --tiny                # CPU, seconds per step
    python3 benchmarks/transformers_rl_bench.py table --out $OUT                 # the table again
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from prime_core.ports import free_ports

SHAPES = {
    # Qwen3's published shapes; the vocabulary stays 151,936 (the LM head's real cost) although
    # the local tokenizer has a few hundred tokens: the random models sample ids it cannot decode.
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=None),
}
LOADED = re.compile(r"^(\S+ \S+) INFO prime\.transformers: loaded weights of step (\d+) from \S+ in ([\d.]+) s"
                    r"(?: \(.*?([\d.]+) s paused)?")
SERVED = re.compile(r"^(\S+ \S+) INFO prime\.transformers: served (\d+) samples, (\d+) tokens on the weights of "
                    r"step (\d+) in ([\d.]+) s busy")


def build_model(folder: Path, shape: str, dtype: str) -> Path:
    """A random model of ``shape`` with the local byte-level tokenizer (no downloads)."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    from prime_plugin_hf.tiny import build_tokenizer

    if (folder / "config.json").exists():
        return folder
    tokenizer = build_tokenizer()
    dims = dict(SHAPES[shape])
    dims["vocab_size"] = dims["vocab_size"] or -(-len(tokenizer) // 64) * 64
    eos, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|pad|>")
    config = Qwen3Config(**dims, max_position_embeddings=8192, tie_word_embeddings=True, eos_token_id=eos,
                         pad_token_id=pad, bos_token_id=None, architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):  # initialising 2B parameters is minutes on a CPU, a second on a GPU
        model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad)
    model.to(getattr(torch, dtype)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run_config(args: argparse.Namespace, async_level: int, gpu: bool) -> str:
    lines = [
        f"max_steps = {args.steps}", f"seq_len = {args.seq_len}", "",
        "[trainer.model]", 'impl = "hf"', f'dtype = "{args.dtype}"', "",
        "[trainer.optim]", "lr = 1e-6", "weight_decay = 0.0", "",
        "[orchestrator]", f"batch_size = {args.batch_size}", f"rollouts_per_example = {args.group}",
        f"max_off_policy_steps = {async_level + 1}", f"async_level = {async_level}", "",
        "[orchestrator.sampling]", "temperature = 1.0", f"max_tokens = {args.max_tokens}", "",
        "[[orchestrator.env]]", 'id = "reverse_text"', "args = { min_len = 8, max_len = 16 }", "",
        "[inference]", f'backend = "{args.backend}"', f"gpu_memory_utilization = {args.gpu_memory_utilization}",
        "startup_timeout = 900", "",
        "[inference.model]", f'dtype = "{args.dtype}"', f"max_model_len = {args.seq_len}", "",
    ]
    if args.backend == "vllm" and not gpu:
        lines.insert(-1, "enforce_eager = true")  # as the CPU example: no compilation on a CPU
    if gpu:
        first = args.first_gpu
        trainer = [first] if args.gpus == 1 else list(range(first + 1, first + args.gpus))
        # several trainer GPUs: the launcher runs the trainer under torchrun, one rank per GPU (FSDP)
        lines += ["[deployment]", f"inference_gpu_ids = [{first}]", f"trainer_gpu_ids = {trainer}",
                  f"num_train_gpus = {len(trainer)}", ""]
    return "\n".join(lines)


def run_one(args: argparse.Namespace, shape: str, model: Path, async_level: int, gpu: bool) -> Path:
    backend = "" if args.backend == "transformers" else f"-{args.backend}"
    transport = "" if args.weight_broadcast == "filesystem" else f"-{args.weight_broadcast}"
    out = args.work / f"{shape}{backend}-async{async_level}{transport}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "rl.toml").write_text(run_config(args, async_level, gpu))
    port = free_ports(1)
    command = [sys.executable, "-m", "prime_core", "run", str(out / "rl.toml"), "--model.name", str(model),
               "--output-dir", str(out / "run"), "--inference.server.port", str(port), "--clean",
               "--weight-broadcast.type", args.weight_broadcast, *args.extra]
    print(f"$ {' '.join(command)}", flush=True)
    start = time.monotonic()
    with open(out / "console.log", "w") as console:
        proc = subprocess.Popen(command, stdout=console, stderr=subprocess.STDOUT,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
        try:
            code = proc.wait(args.timeout)
        except subprocess.TimeoutExpired:  # Ctrl-C's way: the launcher stops every role, then exits
            print(f"  over {args.timeout:.0f} s: stopping the run", flush=True)
            proc.send_signal(signal.SIGINT)
            try:
                code = proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
    (out / "port").write_text(str(port))
    print(f"  exit {code} after {time.monotonic() - start:.0f} s; console: {out / 'console.log'}", flush=True)
    if code != 0:
        print((out / "console.log").read_text()[-3000:], flush=True)
    return out


def keep(run: Path, out: Path) -> None:
    """Copy a run's small files (metrics, logs, config, console) from the work folder to ``out``."""
    import shutil

    target = out / run.name
    if target.resolve() == run.resolve():
        return
    (target / "run" / "logs").mkdir(parents=True, exist_ok=True)
    for name in ("rl.toml", "console.log", "port"):
        if (run / name).exists():
            shutil.copy(run / name, target / name)
    if (run / "run" / "metrics.jsonl").exists():
        shutil.copy(run / "run" / "metrics.jsonl", target / "run" / "metrics.jsonl")
    for log in (run / "run" / "logs").glob("*.log"):
        shutil.copy(log, target / "run" / "logs" / log.name)


def _epoch(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def summarize(out: Path, skip: int, batch_size: int) -> dict | None:
    run = out / "run"
    if not (run / "metrics.jsonl").exists():
        return None
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    trainer = sorted((r for r in rows if r["role"] == "trainer"), key=lambda r: r["step"])
    if len(trainer) <= skip + 1:
        return None
    published = {r["step"]: r["time"] for r in trainer}
    measured = [r for r in trainer if r["step"] > skip]
    walls = [b["time"] - a["time"] for a, b in zip(trainer, trainer[1:], strict=False) if b["step"] > skip]
    port = (out / "port").read_text().strip()
    server_log = run / "logs" / f"transformers-{port}.log"
    log = server_log.read_text().splitlines() if server_log.exists() else []
    loads = [(int(m[2]), _epoch(m[1]), float(m[3])) for m in map(LOADED.match, log) if m]
    served = [(int(m[4]), int(m[2]), int(m[3]), float(m[5])) for m in map(SERVED.match, log) if m]
    window = [s for s in served if skip <= s[0] < trainer[-1]["step"]]  # versions of the steady state
    samples, tokens, busy = (sum(s[i] for s in window) for i in (1, 2, 3))
    if not server_log.exists():  # vLLM: the orchestrator's sampling time per step, waiting on the server
        sampled = [r for r in rows if r["role"] == "orchestrator" and r["step"] > skip]
        samples, busy = sum(r["samples"] for r in sampled), sum(r["step_time"] for r in sampled)
        tokens = sum(r["sample_tokens_per_s"] * r["step_time"] for r in sampled)
    step_time, train_time = statistics.median(walls), statistics.median(r["step_time"] for r in measured)
    inference_time = busy / samples * batch_size if samples else float("nan")
    steady_loads = [(step, at, seconds) for step, at, seconds in loads if step > skip]
    pauses = [float(m[4]) for m in map(LOADED.match, log) if m and m[4] and int(m[2]) > skip]
    config = (out / "rl.toml").read_text()
    return {
        "run": out.name, "async_level": int(re.search(r"async_level = (\d+)", config)[1]),
        "steps": len(trainer), "measured_steps": len(measured),
        "step_time": step_time, "train_time": train_time, "inference_time": inference_time,
        "samples_per_s": samples / busy if busy else float("nan"),
        "tokens_per_s": tokens / busy if busy else float("nan"),
        "weight_load_s": statistics.median(s for _, _, s in steady_loads) if steady_loads else float("nan"),
        "publish_to_served_s": statistics.median(at - published[step] for step, at, _ in steady_loads
                                                 if step in published) if steady_loads else float("nan"),
        "overlap_ratio": step_time / max(train_time, inference_time),
        # where the rest of the trainer's wall time went (older runs did not record these)
        "trainer_wait_s": statistics.median(r.get("wait_time", float("nan")) for r in measured),
        "trainer_publish_s": statistics.median(r.get("publish_time", float("nan")) for r in measured),
        "weights_write_s": statistics.median(r.get("weights_write_time", float("nan")) for r in measured),
        "weight_pause_s": statistics.median(pauses) if pauses else float("nan"),
        "steps_per_hour": 3600.0 / step_time,
        "mismatch_kl_step1": trainer[0]["mismatch_kl"],
        "reward_last": trainer[-1]["reward"],
    }


def table(results: list[dict]) -> str:
    head = ("| run | step s | trainer s | inference s | samples/s | tokens/s | weight load s | publish→served s "
            "| trainer waits s | trainer publishes s | weights written s | generation paused s | overlap | steps/h "
            "| mismatch KL step 1 |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        lines.append(f"| {r['run']} | {r['step_time']:.2f} | {r['train_time']:.2f} | {r['inference_time']:.2f} | "
                     f"{r['samples_per_s']:.1f} | {r['tokens_per_s']:.0f} | {r['weight_load_s']:.2f} | "
                     f"{r['publish_to_served_s']:.2f} | {r.get('trainer_wait_s', float('nan')):.2f} | "
                     f"{r.get('trainer_publish_s', float('nan')):.2f} | {r.get('weights_write_s', float('nan')):.2f} | "
                     f"{r.get('weight_pause_s', float('nan')):.3f} | "
                     f"{r['overlap_ratio']:.2f} | {r['steps_per_hour']:.0f} | "
                     f"{r['mismatch_kl_step1']:.2e} |")
    by = {r["run"]: r for r in results}
    for name, r in by.items():
        sync = by.get(name.replace("-async1", "-async0"))
        if "-async1" in name and sync:
            lines.append(f"\n{name.replace('-async1', '')}: async {r['steps_per_hour']:.0f} vs sync "
                         f"{sync['steps_per_hour']:.0f} steps/h = {r['steps_per_hour'] / sync['steps_per_hour']:.2f}x")
    return "\n".join(lines)


def print_table(out: Path) -> None:
    path = out / "results.jsonl"
    results = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    print(table(results) if results else f"no results in {path}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    only_table = bool(argv) and argv[0] == "table"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, help="where the runs write (checkpoints and weights: gigabytes); "
                                                  "default: --out")
    parser.add_argument("--models", type=Path, help="where the random models are built; default: OUT/models")
    parser.add_argument("--shapes", nargs="+", default=["qwen3-0.6b", "qwen3-1.7b"], choices=sorted(SHAPES))
    parser.add_argument("--async-levels", nargs="+", type=int, default=[1, 0])
    parser.add_argument("--gpus", type=int, default=1, choices=range(1, 9), metavar="N",
                        help="1: inference and trainer share GPU 0; N > 1: inference on the first GPU, the trainer "
                             "on the next N - 1 (under torchrun when N > 2)")
    parser.add_argument("--first-gpu", type=int, default=0,
                        help="the GPU id inference takes (the trainer's is it, or the next with --gpus 2): two runs "
                             "side by side on one host")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--skip", type=int, default=3, help="start-up steps left out of the figures")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per prime run")
    parser.add_argument("--tiny", action="store_true", help="the CPU example's tiny shape on this machine's CPU: "
                                                            "3+ steps of 64 samples, in float32")
    parser.add_argument("--backend", default="transformers", choices=["transformers", "vllm"],
                        help="vllm: inference time is the orchestrator's sampling time per step (no weight load "
                             "figures); its runs are named SHAPE-vllm-async<k>")
    parser.add_argument("--weight-broadcast", default="filesystem", choices=["filesystem", "ipc", "nccl"],
                        help="the weight transport (ipc: shared memory, trainer and inference on one GPU; nccl: "
                             "the process group, on two GPUs or more); its runs are named SHAPE-async<k>-TYPE")
    parser.add_argument("extra", nargs="*", help="more `prime run` arguments, after --")
    args = parser.parse_args(argv[1:] if only_table else argv)
    if only_table:
        print_table(args.out)
        return 0
    if args.tiny:
        args.shapes, args.dtype = ["tiny"], "float32"
        args.steps, args.skip, args.batch_size, args.max_tokens, args.seq_len = 5, 1, 64, 16, 512
    import torch

    gpu = torch.cuda.is_available()
    if not gpu and not args.tiny:
        print("no CUDA GPU here: use --tiny on a CPU", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    args.work, args.models = args.work or args.out, args.models or args.out / "models"
    for shape in args.shapes:
        started = time.monotonic()
        model = build_model(args.models / shape, shape, args.dtype)
        print(f"{shape}: model at {model} ({time.monotonic() - started:.0f} s)", flush=True)
        for level in args.async_levels:
            run = run_one(args, shape, model, level, gpu)
            keep(run, args.out)
            result = summarize(run, args.skip, args.batch_size)
            if result is None:
                print(f"{shape} async_level={level}: no steady-state steps to report", flush=True)
                continue
            result.update(shape=shape, weight_broadcast=args.weight_broadcast, gpus=args.gpus if gpu else 0,
                          device=torch.cuda.get_device_name(0) if gpu
                          else "cpu", batch_size=args.batch_size, max_tokens=args.max_tokens, dtype=args.dtype,
                          gpu_memory_utilization=args.gpu_memory_utilization, when=time.strftime("%Y-%m-%dT%H:%M:%S"))
            with (args.out / "results.jsonl").open("a") as f:
                f.write(json.dumps(result) + "\n")
            print(table([result]), flush=True)
    print_table(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
