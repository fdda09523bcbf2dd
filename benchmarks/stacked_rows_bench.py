"""One training step's forward and backward on the CPU examples' tiny model, three ways side
by side in one run: one packed row per pass (before ``trainer.model.pass_tokens``), the same
rows stacked into passes of ``pass_tokens`` tokens, and the samples re-packed into rows as long
as the longest sample, then stacked (what ``train_step`` does for a model without a
``Packing``). The ways alternate; the table shows the median of ``repeats`` rounds and the
ratio to one row per pass. Every way's loss is checked against the first one's.

Two shapes: ``sft`` (the tool example's warm-up: 64 chat samples of 80-194 tokens in rows of
256) and ``rl`` (the CPU RL example: 256 samples of 50-100 tokens in rows of 2,048).

    python benchmarks/stacked_rows_bench.py --out benchmarks/results/stacked_rows_cpu.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {"sft": {"samples": 64, "prompt": (60, 120), "completion": (20, 74), "seq_len": 256},
          "rl": {"samples": 256, "prompt": (40, 60), "completion": (10, 40), "seq_len": 2048}}


def rows_of(shape: dict, rng: random.Random) -> list[dict]:
    from prime_core.orchestrator.batch import TrainingSample, pack

    samples = []
    for _ in range(shape["samples"]):
        prompt, completion = rng.randint(*shape["prompt"]), rng.randint(*shape["completion"])
        samples.append(TrainingSample([rng.randrange(256) for _ in range(prompt)],
                                      [rng.randrange(256) for _ in range(completion)], [-1.0] * completion,
                                      rng.gauss(0, 1), 0.0, 0))
    return [vars(row) for row in pack(samples, shape["seq_len"])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pass-tokens", type=int, default=2048)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from prime_core.algorithms import default_loss
    from prime_core.distributed import World
    from prime_core.trainer.step import forward_backward, repacked

    folder = Path(tempfile.mkdtemp()) / "tiny"
    subprocess.run([sys.executable, "-m", "prime_core", "model", "tiny", str(folder), "--hidden-size", "128",
                    "--num-layers", "2"], check=True, capture_output=True)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    rng = random.Random(0)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    records = []
    for name, shape in SHAPES.items():
        rows = rows_of(shape, rng)
        short = repacked(rows)
        longest = max(len(row["input_ids"]) for row in short)
        ways = {"one row per pass": (rows, 1),
                "rows stacked": (rows, max(1, args.pass_tokens // shape["seq_len"])),
                "re-packed and stacked": (short, max(1, args.pass_tokens // longest))}
        total = sum(sum(row["loss_mask"]) for row in rows)
        times: dict[str, list[float]] = {way: [] for way in ways}
        losses: dict[str, float] = {}
        for round_ in range(args.repeats + 1):
            for way, (these, per_pass) in ways.items():
                model.zero_grad()
                start = time.perf_counter()
                sums = forward_backward(model, these, total_loss_tokens=total, world=World(),
                                        loss_fn=default_loss if name == "rl" else None, rows_per_pass=per_pass)
                if round_:  # the first round warms up
                    times[way].append(time.perf_counter() - start)
                losses[way] = sums["loss"]
        first = next(iter(ways))
        for way, (these, per_pass) in ways.items():
            assert abs(losses[way] - losses[first]) <= 1e-5 * abs(losses[first]), (way, losses)
            median = statistics.median(times[way])
            records.append({"shape": name, "way": way, "rows": len(these),
                            "row_tokens": max(len(r["input_ids"]) for r in these), "rows_per_pass": per_pass,
                            "median_s": round(median, 4),
                            "vs_one_row_per_pass": round(median / statistics.median(times[first]), 3),
                            "loss": losses[way], "host_cpus": os.cpu_count(), "torch": torch.__version__,
                            "commit": commit, "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
                            "machine": platform.processor() or platform.machine()})
    print(f"{'shape':<5} {'way':<24} {'rows':>5} {'of':>6} {'per pass':>9} {'median s':>9} {'ratio':>6}")
    for r in records:
        print(f"{r['shape']:<5} {r['way']:<24} {r['rows']:>5} {r['row_tokens']:>6} {r['rows_per_pass']:>9} "
              f"{r['median_s']:>9.3f} {r['vs_one_row_per_pass']:>6.2f}")
    if args.out:
        with args.out.open("a") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
