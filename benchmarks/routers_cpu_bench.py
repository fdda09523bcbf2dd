"""Requests/s and tokens/s through vllm-router vs straight to one replica vs two replicas with
the orchestrator's client-side router, side by side in one run (CPU or GPU).

Two vLLM replicas run as one ``prime inference --parallel.dp 2`` (the local launcher's
processes), and one ``prime vllm-router`` process per ``--policies`` entry in front of them
(the command ``prime run`` starts for ``[inference.router]``). Every phase sends the same load
through the orchestrator's own path (``ReplicaPool`` + the vllm backend's client, one rollout
session per request, as episodes do): ``requests`` requests of one sample each, all in flight
at once, ``max_tokens`` tokens at temperature 1. Phases:

- ``one replica``: every request straight to replica 0 (replica 1 idles);
- ``2 replicas, client round_robin``: the orchestrator spreads them itself;
- ``vllm-router <policy>``: every request to the router, which picks an engine.

Rounds alternate the phases (after one warm-up round each), so that a noisy neighbour on a
shared machine hits them alike; the table shows the median of ``repeats`` rounds and the ratio
to ``one replica``, and how the engines split the requests. JSON lines go to ``--out``.

    python benchmarks/routers_cpu_bench.py --out benchmarks/results/routers_cpu.jsonl
    python benchmarks/routers_cpu_bench.py --tiny        # a smoke run
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




class Process:
    """A ``prime`` command in its own process group, stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, argv: list[str], log: Path) -> None:
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "prime_core", *argv], stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
        self.log = log

    def check(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.log.name}: exited with {self.proc.returncode}; see {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def wait_healthy(clients, processes: list[Process], timeout: float) -> float:
    start = time.monotonic()
    for client in clients:
        while not client.health():
            for process in processes:
                process.check()
            if time.monotonic() - start > timeout:
                raise RuntimeError(f"{client.base_url} not healthy within {timeout:.0f} s")
            time.sleep(0.5)
    return time.monotonic() - start


def pool(client_config: dict, make_client):
    from prime_core.orchestrator.config import ClientConfig
    from prime_core.orchestrator.pool import ReplicaPool
    from prime_core.plugins import get_plugin_manager

    config = ClientConfig(**client_config)
    router = get_plugin_manager().select("routers", config.router, key="orchestrator.client.router")
    return ReplicaPool(config, make_client, router)


async def one_round(replicas, prompts: list[list[int]], max_tokens: int, tag: str) -> tuple[float, int]:
    from prime_core.inference.client import SampleRequest

    requests = [SampleRequest(prompt_ids=p, n=1, max_tokens=max_tokens, temperature=1.0, session_id=f"{tag}-{i}")
                for i, p in enumerate(prompts)]
    start = time.perf_counter()
    answers = await asyncio.gather(*(replicas.sample(r) for r in requests))
    return time.perf_counter() - start, sum(len(s.token_ids) for a in answers for s in a)


async def measure(phases: dict, engines: list, args, vocab: int) -> list[dict]:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    runs: dict[str, list[tuple[float, int]]] = {name: [] for name in phases}
    split: dict[str, list[float]] = {}
    for name, replicas in phases.items():  # warm-up: every path, and each engine's first requests
        await one_round(replicas, prompts[: max(2, args.requests // 4)], args.max_tokens, f"warm-{name}")
    for repeat in range(args.repeats):
        for name, replicas in phases.items():
            before = [await e.requests_served() for e in engines]
            runs[name].append(await one_round(replicas, prompts, args.max_tokens, f"r{repeat}-{name}"))
            after = [await e.requests_served() for e in engines]
            split[name] = [b - a for a, b in zip(before, after, strict=True)]
            seconds, tokens = runs[name][-1]
            print(f"  round {repeat + 1}: {name}: {args.requests / seconds:.1f} requests/s, "
                  f"{tokens / seconds:.0f} tokens/s, engines {split[name]}", flush=True)
    rows = []
    for name, results in runs.items():
        rps = [args.requests / s for s, _ in results]
        tps = [t / s for s, t in results]
        rows.append({"phase": name, "requests": args.requests, "max_tokens": args.max_tokens,
                     "prompt_len": args.prompt_len, "seconds": [round(s, 3) for s, _ in results],
                     "requests_per_s": [round(r, 2) for r in rps], "tokens_per_s": [round(t, 1) for t in tps],
                     "median_requests_per_s": round(statistics.median(rps), 2),
                     "median_tokens_per_s": round(statistics.median(tps), 1),
                     "engine_split_last_round": split[name]})
    return rows


def table(rows: list[dict]) -> str:
    base = rows[0]
    lines = ["| path | requests/s (median) | tokens/s (median) | vs one replica | engines (last round) |",
             "|---|---|---|---|---|"]
    for row in rows:
        ratio = row["median_tokens_per_s"] / base["median_tokens_per_s"]
        split = "/".join(str(int(n)) for n in row["engine_split_last_round"])
        lines.append(f"| {row['phase']} | {row['median_requests_per_s']:.1f} | {row['median_tokens_per_s']:.0f} | "
                     f"{ratio:.2f} | {split} |")
    return "\n".join(lines)


def start(args, work: Path, model: Path):
    """The two replicas, and one router per policy; their ports."""
    port = free_ports(2 + 2 * len(args.policies))
    engines = [f"http://127.0.0.1:{port + i}/v1" for i in range(2)]
    serving = Process(["inference", "--model.name", str(model), "--model.dtype", "float32", "--model.enforce-eager",
                       "--model.max-model-len", str(args.max_model_len), "--server.port", str(port),
                       "--parallel.dp", "2", "--output-dir", str(work / "serve"),
                       "--env", '{"VLLM_CPU_OMP_THREADS_BIND": "nobind"}'], work / "serve.log")
    processes, routers = [serving], {}
    resolved = work / "serve" / "configs" / "inference.json"
    while not resolved.exists():
        serving.check()
        time.sleep(0.2)
    for i, policy in enumerate(args.policies):
        config = json.loads(resolved.read_text())
        config["router"] = {"policy": policy, "port": port + 2 + 2 * i, "metrics_port": port + 3 + 2 * i}
        path = work / f"router-{policy}.json"
        path.write_text(json.dumps(config))
        processes.append(Process(["vllm-router", str(path)], work / f"router-{policy}.log"))
        routers[policy] = f"http://127.0.0.1:{port + 2 + 2 * i}/v1"
    return processes, engines, routers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a Hugging Face folder (default: a tiny model built under --work)")
    parser.add_argument("--policies", nargs="+", default=["round_robin", "consistent_hash"],
                        help="vllm-router policies, one router process each")
    parser.add_argument("--requests", type=int, default=64, help="requests in flight at once (one sample each)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--work", type=Path, help="folder for the model and the servers' logs (default: temporary)")
    parser.add_argument("--out", type=Path, help="append one JSON line per phase here")
    parser.add_argument("--tiny", action="store_true", help="a smoke run: 8 requests of 4 tokens, once")
    args = parser.parse_args(argv)
    if args.tiny:
        args.requests, args.max_tokens, args.repeats, args.prompt_len = 8, 4, 1, 8
    work = args.work or Path(tempfile.mkdtemp(prefix="prime-routers-"))
    if args.model is None:
        from prime_plugin_hf.tiny import build_tiny

        args.model = work / "model"
        if not (args.model / "config.json").exists():
            build_tiny(args.model, hidden_size=128, num_layers=2, dtype="float32")
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    from prime_plugin_vllm.client import VLLMClient

    def client(url):
        return VLLMClient(url, api_key=None, timeout=3600.0)

    processes, engine_urls, routers = start(args, work, args.model)
    try:
        phases = {"one replica": pool({"base_url": engine_urls[:1]}, client),
                  "2 replicas, client round_robin": pool({"base_url": engine_urls, "router": "round_robin"}, client)}
        for policy, url in routers.items():
            phases[f"vllm-router {policy}"] = pool({"base_url": [url], "admin_base_url": engine_urls}, client)
        engines = [client(url) for url in engine_urls]
        started = wait_healthy([*engines, *(client(u) for u in routers.values())], processes, args.startup_timeout)
        print(f"2 engines and {len(routers)} router(s) healthy after {started:.0f} s", flush=True)

        async def run_all():
            try:
                return await measure(phases, engines, args, vocab)
            finally:
                for replicas in phases.values():
                    for each in replicas.clients.values():
                        await each.close()

        rows = asyncio.run(run_all())
    finally:
        for process in reversed(processes):
            process.stop()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    print(table(rows))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        dims = json.loads((args.model / "config.json").read_text())
        shape = {k: dims.get(k) for k in ("hidden_size", "num_hidden_layers", "vocab_size")}  # not its path
        with args.out.open("a") as f:
            for row in rows:
                f.write(json.dumps({**row, "model": shape, "when": stamp, "host_cpus": os.cpu_count(),
                                    "vllm_router": _version("vllm-router")}) + "\n")
    return 0


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


if __name__ == "__main__":
    sys.exit(main())
