"""Step batch write + read time and bytes, JSON vs binary, side by side in one run (CPU).

The batch is what the orchestrator writes for one step: ``samples`` training samples of
``tokens`` tokens each (a prompt of 256 to 2,048 tokens, the rest completion; every fourth
sample is multi-turn, with environment turns masked out), packed by ``pack`` into rows of
``seq_len`` tokens, token ids from a 151,936-token vocabulary, log-probabilities as vLLM returns
them (float32 values in Python floats) and GRPO advantages of random rewards. Each round writes
the batch with ``write_batch`` (encoding, fsync, rename) and reads it back with
``read_batch`` (decoding and checks: what the trainer gets), in each format, the formats
alternating; the table shows the median of ``repeats`` rounds, and the ratios JSON / binary.
The reads of both formats are checked equal.

    python benchmarks/batch_format_bench.py --out benchmarks/results/batch_format_cpu.jsonl
    python benchmarks/batch_format_bench.py --tiny       # a smoke run, seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prime_core.orchestrator.batch import TrainingSample, pack, read_batch, write_batch  # noqa: E402
from prime_core.orchestrator.batch_format import ARRAYS  # noqa: E402

VOCAB = 151_936
FORMATS = ("json", "binary")


def make_samples(count: int, tokens: int, seed: int) -> list[TrainingSample]:
    rng = np.random.default_rng(seed)
    rewards = rng.random(count)
    group = 16
    samples = []
    for i in range(count):
        n_prompt = int(rng.integers(min(256, tokens // 4), min(2048, tokens // 2) + 1))
        n_completion = tokens - n_prompt
        mask = None
        if i % 4 == 0:  # multi-turn: model turns with environment turns (mask 0) between them
            mask = np.ones(n_completion, dtype=np.int64)
            for start in rng.integers(0, n_completion, size=4):
                mask[start:start + int(rng.integers(8, 200))] = 0
            mask = mask.tolist()
        g = rewards[(i // group) * group:(i // group + 1) * group]
        samples.append(TrainingSample(
            prompt_ids=rng.integers(0, VOCAB, n_prompt).tolist(),
            completion_ids=rng.integers(0, VOCAB, n_completion).tolist(),
            completion_logprobs=(-rng.exponential(1.0, n_completion)).astype(np.float32).tolist(),
            advantage=float(rewards[i] - g.mean()), reward=float(rewards[i]), version=3, env="bench",
            completion_mask=mask))
    return samples


def measure(work: Path, rows, fmt: str, step: int) -> tuple[dict, dict]:
    gc.collect()
    start = time.perf_counter()
    path = write_batch(work, step, rows, temperature=1.0, info={"reward": 0.5, "versions": [3]}, format=fmt)
    written = time.perf_counter()
    batch = read_batch(path)
    done = time.perf_counter()
    return {"write_s": written - start, "read_s": done - written, "bytes": path.stat().st_size}, batch


def same(a: dict, b: dict) -> bool:
    if len(a["micro_batches"]) != len(b["micro_batches"]) or a["info"] != b["info"]:
        return False
    return all(np.array_equal(x[k], y[k]) and x[k].dtype == y[k].dtype
               for x, y in zip(a["micro_batches"], b["micro_batches"], strict=True) for k in ARRAYS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per sample (prompt + completion)")
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=None, help="where the step files go (a temporary folder)")
    parser.add_argument("--out", type=Path, default=None, help="append one JSON line per format here")
    parser.add_argument("--tiny", action="store_true", help="16 samples of 512 tokens, one round")
    args = parser.parse_args()
    if args.tiny:
        args.samples, args.tokens, args.seq_len, args.repeats = 16, 512, 1024, 1

    work = args.work or Path(tempfile.mkdtemp(prefix="batch_format_bench."))
    made = time.perf_counter()
    rows = pack(make_samples(args.samples, args.tokens, args.seed), args.seq_len)
    tokens = sum(len(r) for r in rows)
    print(f"{args.samples} samples x {args.tokens} tokens -> {len(rows)} rows of <= {args.seq_len} "
          f"({tokens:,} tokens), built in {time.perf_counter() - made:.1f} s; files in {work}", flush=True)

    runs: dict[str, list[dict]] = {f: [] for f in FORMATS}
    try:
        step = 0
        for round_ in range(args.repeats):
            reads = {}
            for fmt in FORMATS if round_ % 2 == 0 else FORMATS[::-1]:
                step += 1
                result, reads[fmt] = measure(work, rows, fmt, step)
                runs[fmt].append(result)
                print(f"round {round_ + 1} {fmt:>6}: write {result['write_s']:.3f} s, read {result['read_s']:.3f} s, "
                      f"{result['bytes']:,} bytes", flush=True)
            if not same(reads["json"], reads["binary"]):
                raise SystemExit("the two formats read back different batches")
            del reads
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)

    summary = {}
    for fmt in FORMATS:
        write = statistics.median(r["write_s"] for r in runs[fmt])
        read = statistics.median(r["read_s"] for r in runs[fmt])
        summary[fmt] = {"write_s": write, "read_s": read, "total_s": write + read, "bytes": runs[fmt][0]["bytes"]}
    j, b = summary["json"], summary["binary"]
    ratios = {"speedup": j["total_s"] / b["total_s"], "write_speedup": j["write_s"] / b["write_s"],
              "read_speedup": j["read_s"] / b["read_s"], "smaller": j["bytes"] / b["bytes"]}

    print("\n| format | write s | read s | write + read s | bytes | bytes/token |\n|---|---|---|---|---|---|")
    for fmt in FORMATS:
        s = summary[fmt]
        print(f"| {fmt} | {s['write_s']:.3f} | {s['read_s']:.3f} | {s['total_s']:.3f} | {s['bytes']:,} | "
              f"{s['bytes'] / tokens:.1f} |")
    print(f"\nbinary vs json: {ratios['speedup']:.1f}x faster (write {ratios['write_speedup']:.1f}x, read "
          f"{ratios['read_speedup']:.1f}x), {ratios['smaller']:.1f}x smaller (median of {args.repeats})")

    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        common = {"samples": args.samples, "tokens_per_sample": args.tokens, "seq_len": args.seq_len, "rows": len(rows),
                  "tokens": tokens, "repeats": args.repeats, "tiny": args.tiny, "cpus": os.cpu_count(),
                  "machine": platform.processor() or platform.machine(), "python": platform.python_version(),
                  "load_average": os.getloadavg(),  # other jobs on a shared machine: read the ratios with it
                  "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        with args.out.open("a") as f:
            for fmt in FORMATS:
                extra = {f"{k}_vs_json": v for k, v in ratios.items()} if fmt == "binary" else {}
                f.write(json.dumps({"format": fmt, **common, **summary[fmt],
                                    "runs": runs[fmt], **extra}) + "\n")
    return 0


if __name__ == "__main__":
    random.seed(0)
    sys.exit(main())
