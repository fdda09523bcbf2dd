"""Inference backends side by side: sampling tokens/s of each backend at a number of concurrent
samples, on the same model, through each backend's own client (as the orchestrator samples).

Each backend runs as a real ``prime inference`` process, one after the other (never two at
once), on the same local model; the load is ``concurrency / group`` requests of ``group``
samples each (GRPO groups), all in flight at once, ``max_tokens`` tokens at temperature 1,
repeated ``repeats`` times after a warm-up round. Prints a table and appends JSON lines to
``--out``.

    python benchmarks/inference_backends_bench.py                 # the CPU example's tiny model
    python benchmarks/inference_backends_bench.py --model DIR --concurrency 64 256 --max-tokens 128
    python benchmarks/inference_backends_bench.py --tiny          # seconds: a smoke run (tests)
    python3 benchmarks/inference_backends_bench.py --model DIR --dtype bfloat16 \
        --variant sdpa transformers '{}' --variant graphs transformers '{"use_cuda_graph": true}'
                                                                  # one backend's settings side by side
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prime_core.ports import free_ports

ROOT = Path(__file__).resolve().parents[1]


def build_model(folder: Path, hidden_size: int, num_layers: int) -> Path:
    from prime_plugin_hf.tiny import build_tiny

    if not (folder / "config.json").exists():
        build_tiny(folder, hidden_size=hidden_size, num_layers=num_layers, dtype="float32")
    return folder


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def backend_spec(name: str):
    from prime_core.plugins import get_plugin_manager

    entry = get_plugin_manager().registry("inference_backends").get(name)
    if entry is None:
        return None, f"no inference backend '{name}' is installed"
    return entry.spec, entry.spec.unavailable_reason()


class Served:
    """``prime inference`` with one backend, started and stopped around a ``with`` block."""

    def __init__(self, backend: str, model: Path, out: Path, args: argparse.Namespace,
                 backend_args: dict | None = None) -> None:
        self.backend, self.port, self.out = backend, free_ports(1), out
        self.command = [sys.executable, "-m", "prime_core", "inference", "--backend", backend, "--model.name",
                        str(model), "--model.dtype", args.dtype, "--model.max-model-len", str(args.max_model_len),
                        "--server.port", str(self.port), "--output-dir", str(out)]
        if args.gpu_memory_utilization is not None:
            self.command += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
        if backend_args:
            self.command += ["--args", json.dumps(backend_args)]
        if backend == "vllm":
            self.command.append("--model.enforce-eager")  # as the CPU example: no compilation on a CPU
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Served:
        self.out.mkdir(parents=True, exist_ok=True)
        log = open(self.out / "prime-inference.log", "w")  # noqa: SIM115 - the process owns it
        self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "HF_HUB_OFFLINE": "1"}, start_new_session=True)
        return self

    def wait_healthy(self, client, timeout: float) -> float:
        start = time.monotonic()
        while not client.health():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.backend}: prime inference exited with {self.proc.returncode}; see "
                                   f"{self.out / 'prime-inference.log'}")
            if time.monotonic() - start > timeout:
                raise RuntimeError(f"{self.backend}: not healthy within {timeout:.0f} s")
            time.sleep(0.5)
        return time.monotonic() - start

    def __exit__(self, *exc) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)  # the role stops its server (and vLLM's process tree)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


async def one_round(client, prompts: list[list[int]], group: int, max_tokens: int) -> tuple[float, int, int]:
    from prime_core.inference.client import SampleRequest

    requests = [SampleRequest(prompt_ids=p, n=group, max_tokens=max_tokens, temperature=1.0) for p in prompts]
    start = time.perf_counter()
    answers = await asyncio.gather(*(client.sample(r) for r in requests))
    seconds = time.perf_counter() - start
    return seconds, sum(len(a) for a in answers), sum(len(s.token_ids) for a in answers for s in a)


def measure(spec, served: Served, args: argparse.Namespace, vocab: int, label: str) -> list[dict]:
    rng = random.Random(0)
    client_of = spec.client

    async def run_all() -> list[dict]:
        client = client_of(served.url, api_key=None, timeout=3600.0)
        rows = []
        try:
            for concurrency in args.concurrency:
                count = max(1, concurrency // args.group)
                prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(count)]
                await one_round(client, prompts[:max(1, count // 4)], args.group, args.max_tokens)  # warm-up
                runs = [await one_round(client, prompts, args.group, args.max_tokens) for _ in range(args.repeats)]
                rates = [tokens / seconds for seconds, _, tokens in runs]
                rows.append({"backend": label, "concurrency": count * args.group, "requests": count,
                             "group": args.group, "max_tokens": args.max_tokens, "prompt_len": args.prompt_len,
                             "samples": runs[0][1], "tokens": [t for _, _, t in runs],
                             "seconds": [round(s, 3) for s, _, _ in runs], "tokens_per_s": [round(r, 1) for r in rates],
                             "median_tokens_per_s": round(statistics.median(rates), 1),
                             "best_tokens_per_s": round(max(rates), 1)})
                print(f"  {label}: {count * args.group} concurrent samples: "
                      f"{', '.join(f'{r:.0f}' for r in rates)} tokens/s", flush=True)
        finally:
            await client.close()
        return rows

    return asyncio.run(run_all())


def table(rows: list[dict]) -> str:
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    levels = sorted({r["concurrency"] for r in rows})
    by = {(r["backend"], r["concurrency"]): r for r in rows}
    head = "| concurrent samples | " + " | ".join(f"{b} tokens/s (median, best)" for b in backends)
    if len(backends) == 2:
        head += f" | {backends[0]} / {backends[1]} (median)"
    lines = [head + " |", "|" + "---|" * (head.count("|"))]
    for level in levels:
        cells = [f"{by[b, level]['median_tokens_per_s']:.0f}, {by[b, level]['best_tokens_per_s']:.0f}"
                 if (b, level) in by else "-" for b in backends]
        if len(backends) == 2 and all((b, level) in by for b in backends):
            a, b = (by[x, level]["median_tokens_per_s"] for x in backends)
            cells.append(f"{a / b:.2f}")
        lines.append(f"| {level} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a Hugging Face folder (default: the CPU example's tiny model, "
                                                   "built under --work)")
    parser.add_argument("--backends", nargs="+", default=["transformers", "vllm"])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[64, 256])
    parser.add_argument("--group", type=int, default=8, help="samples per request (n)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--work", type=Path, help="folder for the model and the servers' outputs (default: a "
                                                  "temporary one)")
    parser.add_argument("--out", type=Path, help="append one JSON line per backend and concurrency here")
    parser.add_argument("--dtype", default="float32", help="the served model's dtype (bfloat16 on a GPU)")
    parser.add_argument("--gpu-memory-utilization", type=float, help="inference.gpu_memory_utilization")
    parser.add_argument("--variant", nargs=3, action="append", metavar=("LABEL", "BACKEND", "ARGS_JSON"),
                        help="serve BACKEND with inference.args = ARGS_JSON, labelled LABEL (repeatable; replaces "
                             "--backends)")
    parser.add_argument("--tiny", action="store_true", help="a smoke run in seconds: a smaller model, 8 and 16 "
                                                            "concurrent samples of 8 tokens, once")
    args = parser.parse_args(argv)
    if args.tiny:
        args.concurrency, args.max_tokens, args.repeats, args.prompt_len = [8, 16], 8, 1, 8
    work = args.work or Path(tempfile.mkdtemp(prefix="prime-backends-"))
    model = args.model or build_model(work / "model", 64 if args.tiny else 128, 2)
    dims = json.loads((model / "config.json").read_text())
    vocab = dims["vocab_size"]
    # The model's shape, not its path: results are committed and paths are this machine's.
    shape = {k: dims.get(k) for k in ("hidden_size", "num_hidden_layers", "vocab_size")}
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    rows, skipped = [], []
    variants = [(label, name, json.loads(raw)) for label, name, raw in args.variant or []]
    for label, name, backend_args in variants or [(name, name, {}) for name in args.backends]:
        spec, why = backend_spec(name)
        if why:
            skipped.append(f"{name}: {why}")
            print(f"skipping {label}: {why}", flush=True)
            continue
        with Served(name, model, work / f"serve-{label}", args, backend_args) as served:
            started = served.wait_healthy(spec.client(served.url, api_key=None, timeout=10.0), args.startup_timeout)
            print(f"{label}: healthy after {started:.1f} s", flush=True)
            for row in measure(spec, served, args, vocab, label):
                rows.append({**row, "backend_name": name, "args": backend_args, "model": shape,
                             "dtype": args.dtype, "startup_s": round(started, 1), "when": stamp,
                             "host_cpus": os.cpu_count(), "device": device_name()})
    print(table(rows))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
