"""Weight update latency, filesystem vs broadcast (``weight_broadcast.type = "nccl"``, gloo on
a CPU), side by side in one run: from the trainer's publish to every replica serving the new
version.

This process plays trainer rank 0 and the orchestrator: it holds the model (a Hugging Face
module, as the trainer's ``hf`` implementation), changes its weights before every update, and
times ``publish`` plus every replica's ``load_weights`` through the vllm backend's client (the
orchestrator's own path), which returns once the engine serves the new weights and has reset
its prefix cache:

- ``filesystem``: ``FilesystemPublisher.publish`` (safetensors, fsync, rename, marker), then
  every replica reloads the folder;
- ``nccl``: ``BroadcastPublisher.publish`` (announce, then send the buckets over the group)
  while every replica receives and loads them.

With ``--backend transformers`` the replicas are transformers servers (their client is the
orchestrator's path too), and a third transport is timed: ``ipc`` (``SharedPublisher.publish``
copies the version into a shared slot, then every replica copies it in).

The replicas run as one ``prime inference --parallel.dp R``. Rounds alternate the two
transports after one warm-up update each (the broadcast's first one also forms the group); the
table shows the median of ``repeats`` updates and the ratio. After every update each replica's
greedy probe is scored by this process's model: the log-probabilities vLLM reports must match
the trainer's for the new weights, so a replica that kept the old ones fails the run. Models:
``tiny`` (the CPU example's shape) and ``0.5b`` (a random Qwen3 of about 0.5B parameters, bf16).

    python benchmarks/weight_update_bench.py --out benchmarks/results/weight_update_cpu.jsonl
    python benchmarks/weight_update_bench.py --models tiny --repeats 1     # a smoke run
    python benchmarks/weight_update_bench.py --backend transformers        # the same into transformers servers
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from prime_core.ports import free_ports

MODELS = {
    "tiny": {"hidden_size": 128, "num_layers": 2, "dtype": "float32"},
    # ~0.5B parameters: Qwen3-0.6B's layer shape (GQA 16/8 heads of 128), 32 layers, prime's small vocabulary
    "0.5b": {"hidden_size": 1024, "num_layers": 32, "num_heads": 16, "num_kv_heads": 8, "head_dim": 128,
             "intermediate_size": 3072, "dtype": "bfloat16"},
}
TOLERANCE = {"float32": 1e-3, "bfloat16": 0.25}
"""Largest |vLLM - trainer| of a probe's summed log-probability (bf16 sums 8 tokens' rounding)."""




class Serving:
    """``prime inference --parallel.dp R`` in its own process group."""

    def __init__(self, model: Path, dtype: str, replicas: int, work: Path, backend: str = "vllm") -> None:
        self.port = free_ports(replicas)
        self.urls = [f"http://127.0.0.1:{self.port + i}/v1" for i in range(replicas)]
        work.mkdir(parents=True, exist_ok=True)
        self.log = work / "serve.log"
        own = ["--model.enforce-eager", "--env", '{"VLLM_CPU_OMP_THREADS_BIND": "nobind"}'] if backend == "vllm" \
            else []
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "prime_core", "inference", "--backend", backend, "--model.name", str(model),
                 "--model.dtype", dtype, "--model.max-model-len", "256", "--server.port", str(self.port),
                 "--parallel.dp", str(replicas), "--output-dir", str(work / "serve"), "--startup-timeout", "1200",
                 *own],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "HF_HUB_OFFLINE": "1"})

    def wait_healthy(self, clients, timeout: float) -> float:
        start = time.monotonic()
        for client in clients:
            while not client.health():
                if self.proc.poll() is not None:
                    raise RuntimeError(f"prime inference exited with {self.proc.returncode}; see {self.log}")
                if time.monotonic() - start > timeout:
                    raise RuntimeError(f"{client.base_url} not healthy within {timeout:.0f} s; see {self.log}")
                time.sleep(0.5)
        return time.monotonic() - start

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def perturb(model, step: int) -> None:
    """New weights for version ``step`` (small noise, so that the greedy outputs change a little)."""
    import torch

    generator = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            param.add_((noise * param.float().std().clamp_min(1e-3) * 0.05).to(param.dtype))


async def update(transport: str, publisher, clients, model, step: int) -> float:
    """Seconds from the start of ``publish`` to every replica serving version ``step``."""
    start = time.perf_counter()
    if transport != "nccl":  # complete when publish returns; then every replica loads it
        path = publisher.publish(model, step, None)
        await asyncio.gather(*(c.load_weights(step, str(path)) for c in clients))
        return time.perf_counter() - start
    result: dict = {}

    def send() -> None:
        try:
            result["path"] = publisher.publish(model, step, None)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the benchmark's thread
            result["error"] = exc

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    folder = publisher.root / f"step_{step}"
    while not (folder / "STABLE").exists():  # the orchestrator's cue, as its loader sees it
        if "error" in result:
            raise result["error"]
        await asyncio.sleep(0.005)
    await asyncio.gather(*(c.load_weights(step, str(folder)) for c in clients))
    await asyncio.to_thread(thread.join)
    if "error" in result:
        raise result["error"]
    return time.perf_counter() - start


async def check_serving(clients, model, prompt: list[int], dtype: str, step: int, last: dict) -> float:
    """Every replica's greedy probe, scored by ``model`` and changed since the last version
    (``last``: each replica's previous probe); returns the largest difference."""
    import torch

    from prime_core.inference.client import SampleRequest

    worst = 0.0
    request = SampleRequest(prompt_ids=prompt, n=1, max_tokens=8, temperature=0.0, session_id="probe")
    for client in clients:
        (sample,) = await client.sample(request)
        ids = torch.tensor([prompt + sample.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1:-1].float()
        ours = torch.log_softmax(logits, -1).gather(-1, torch.tensor(sample.token_ids)[:, None]).sum().item()
        diff = abs(ours - sum(sample.logprobs))
        if diff > TOLERANCE[dtype]:
            raise RuntimeError(f"v{step} on {client.base_url}: the server's probe logprob {sum(sample.logprobs):.4f} "
                               f"but the trainer's {ours:.4f}: the replica does not serve the new weights")
        probe = (tuple(sample.token_ids), sum(sample.logprobs))
        if last.get(client.base_url) == probe:
            raise RuntimeError(f"v{step} on {client.base_url}: the probe did not change: old weights served")
        last[client.base_url] = probe
        worst = max(worst, diff)
    return worst


def bench_model(name: str, args, work: Path) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    from prime_core.weights import FilesystemPublisher
    from prime_plugin_hf.tiny import build_tiny
    from prime_plugin_vllm.broadcast import BroadcastPublisher

    if args.backend == "vllm":
        from prime_plugin_vllm.client import VLLMClient as Client
    else:
        from prime_plugin_transformers.client import TransformersClient as Client

    shape = dict(MODELS[name])
    dtype = shape.pop("dtype")
    folder = work / name / "model"
    if not (folder / "config.json").exists():
        build_tiny(folder, dtype=dtype, **shape)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    params = sum(p.numel() for p in model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"{name}: {params / 1e6:.1f}M parameters, {nbytes / 2**20:.0f} MiB ({dtype}), {args.replicas} replicas",
          flush=True)
    serving = Serving(folder, dtype, args.replicas, work / name / args.backend, args.backend)
    clients = [Client(url, api_key=None, timeout=3600.0) for url in serving.urls]
    try:
        started = serving.wait_healthy(clients, args.startup_timeout)
        print(f"  {args.replicas} replicas healthy after {started:.0f} s", flush=True)
        config = argparse.Namespace(weight_broadcast=argparse.Namespace(
            host="127.0.0.1", port=0, timeout=600.0, inference_world_size=args.replicas, bucket_mb=args.bucket_mb))
        runs_in = work / name / args.backend
        for old in ("fs", "nccl", "ipc"):  # a reused --work: a stale version would be taken for a new one
            shutil.rmtree(runs_in / old, ignore_errors=True)
        publishers = {"filesystem": FilesystemPublisher(output_dir=runs_in / "fs"),
                      "nccl": BroadcastPublisher(config, output_dir=runs_in / "nccl")}
        if args.backend == "transformers":
            from prime_plugin_transformers.shared_weights import SharedPublisher

            publishers["ipc"] = SharedPublisher(output_dir=runs_in / "ipc")
        prompt = [17, 42, 99, 5, 64, 120, 7, 33]
        runs: dict[str, list[float]] = {t: [] for t in publishers}
        warm: dict[str, float] = {}
        worst, last = 0.0, {}

        async def rounds() -> None:
            nonlocal worst
            step = 0
            for repeat in range(args.repeats + 1):
                for transport, publisher in publishers.items():
                    step += 1
                    perturb(model, step)
                    seconds = await update(transport, publisher, clients, model, step)
                    worst = max(worst, await check_serving(clients, model, prompt, dtype, step, last))
                    if repeat == 0:
                        warm[transport] = seconds
                    else:
                        runs[transport].append(seconds)
                    print(f"  {'warm-up' if repeat == 0 else f'round {repeat}'}: {transport} v{step}: "
                          f"{seconds:.3f} s", flush=True)
            for client in clients:
                await client.close()

        asyncio.run(rounds())
    finally:
        serving.stop()
    rows = []
    for transport, seconds in runs.items():
        rows.append({"model": name, "backend": args.backend, "parameters": params, "bytes": nbytes, "dtype": dtype,
                     "replicas": args.replicas,
                     "transport": transport, "seconds": [round(s, 4) for s in seconds],
                     "median_s": round(statistics.median(seconds), 4), "first_s": round(warm[transport], 4),
                     "bucket_mb": args.bucket_mb if transport == "nccl" else None,
                     "max_probe_logprob_diff": round(worst, 6)})
    base = rows[0]["median_s"]
    for row in rows:
        row["vs_filesystem"] = round(row["median_s"] / base, 3)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | backend | parameters | transport | replicas | update (median) | first | vs filesystem |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} ({r['dtype']}) | {r.get('backend', 'vllm')} | {r['parameters'] / 1e6:.1f}M | "
                     f"{r['transport']} | "
                     f"{r['replicas']} | {r['median_s'] * 1000:.0f} ms | {r['first_s'] * 1000:.0f} ms | "
                     f"{r['vs_filesystem']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--backend", default="vllm", choices=["vllm", "transformers"])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=256.0)
    parser.add_argument("--startup-timeout", type=float, default=1200.0)
    parser.add_argument("--work", type=Path, help="folder for models, weights and logs (default: temporary)")
    parser.add_argument("--out", type=Path, help="append one JSON line per model and transport here")
    args = parser.parse_args(argv)
    # This process is the trainer here and shares the cores with the replicas: its OpenMP threads
    # sleep when idle, as `prime run` has every role's do (set before torch is imported).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    work = args.work or Path(tempfile.mkdtemp(prefix="prime-weights-"))
    rows = []
    for name in args.models:
        rows += bench_model(name, args, work)
    print(table(rows))
    if args.out:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as f:
            for row in rows:
                f.write(json.dumps({**row, "when": stamp, "host_cpus": os.cpu_count(), "commit": _commit(),
                                    "omp_wait_policy": os.environ["OMP_WAIT_POLICY"]}) + "\n")
    return 0


def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent)
    return done.stdout.strip() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
