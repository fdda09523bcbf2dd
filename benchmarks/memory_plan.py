#!/usr/bin/env python3
"""``prime plan``'s predictions beside what the GPU runs measured, and the per-GPU memory of
Qwen3-30B-A3B's shape on 8 GPUs. Runs on a CPU in seconds (models are built on the meta
device from a ``config.json``; nothing is loaded).

    python benchmarks/memory_plan.py compare      # every run of results/trainer_h200.jsonl and
                                                  # results/parallel_h200.jsonl: measured, predicted, error
    python benchmarks/memory_plan.py qwen3-30b    # ep 4 and ep 8 on 8 GPUs, experts replicated over
                                                  # dp_mod_ep (before) and FSDP-sharded over it (now)

``tests/test_memory_plan.py`` asserts the comparison (15% on single-GPU rows).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
EXCLUDED = {
    ("custom_fast_bf16", "s5-bf16-with-fsdp"):
        "measured through FSDP, which one process computing in its master dtype no longer uses",
    ("ep4", 8): "measured while experts were replicated over dp_mod_ep (now FSDP-sharded over it)",
    ("custom_fast_bf16", "s5-closing"):
        "measured with the LM head's 2 GiB chunks and both float32 gradient buffers (the lean head holds 0.5 GiB "
        "at 32k); measured again as s29-lean-head",
}
"""Recorded rows whose configuration the current code does not run (rows with a ``note``,
superseded runs, are left out as well)."""


def bench_module(name: str):
    """``benchmarks/<name>.py`` (their configs are the runs' own)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def model_folder(path: Path, shape: dict, moe: bool) -> Path:
    """A folder with the shape's ``config.json`` and an empty safetensors file: enough for the
    config checks and a meta-device build."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    if not (path / "config.json").exists():
        config = (Qwen3MoeConfig if moe else Qwen3Config)(**shape)
        config.architectures = ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"]
        config.save_pretrained(path)
        (path / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")
    return path


def recorded_runs(models: Path) -> list[dict]:
    """Every recorded run: label, trainer.model keys, model folder, row length, samples per
    step, GPUs, measured peak GiB (``None`` for an OOM) and device size."""
    memory, parallel = bench_module("trainer_memory"), bench_module("parallel_bench")
    dense = model_folder(models / "qwen3-1.7b", memory.QWEN3_1_7B, False)
    runs = []
    for line in (RESULTS / "trainer_h200.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "note" in r or (r["config"], r.get("device_call")) in EXCLUDED:
            continue
        if "peak_memory_gib" not in r and not r.get("oom"):  # a profile: no memory measured
            continue
        keys = {**memory.PINNED, **(memory.ALL_KNOBS if r["config"] == "all" else memory.KNOBS[r["config"]])}
        # Rows of varying length: a step's tokens fill at least this many rows of seq_len.
        samples = math.ceil(r["tokens_per_step"] / r["seq_len"]) if "tokens_per_step" in r else r.get("devices", 1)
        runs.append({"label": f"{r['kind']} {r['config']} ({r.get('device_call')})", "model": {"impl": "hf", **keys},
                     "folder": dense, "seq_len": r["seq_len"], "samples": samples, "gpus": r.get("devices", 1),
                     "peak": r.get("peak_memory_gib"), "device": r.get("device_memory_gib", 139.8),
                     "head_recomputed": "lm_head" not in r})
    for line in (RESULTS / "parallel_h200.jsonl").read_text().splitlines():
        r = json.loads(line)
        if (r["config"], r["devices"]) in EXCLUDED:
            continue
        if r["kind"] == "moe":
            name = "qwen3-30b-a3b" if "30b" in r.get("model", "") else "moe"
            layers = 12 if r.get("model", "").endswith("-12l") else None
            folder = model_folder(models / f"{name}{layers or ''}", parallel.model_shape("moe", name, layers, False),
                                  True)
            keys = {"impl": "custom", **parallel.PINNED,
                    "ep": int(r["config"][2:].split("-")[0]) if r["config"].startswith("ep") else 1}
            if r["config"].endswith("-tight"):
                keys.update(parallel.MEMORY_TIGHT, cp_style="ulysses")
        else:
            folder = model_folder(models / "cp-dense", parallel.model_shape("cp", "moe", None, False), False)
            cp = 1 if r["config"] == "cp1" else int(r["config"][2:].split("-")[0])
            keys = {"impl": "custom", **parallel.PINNED, "ac": {"freq": 1}, "cp": cp,
                    "cp_style": r["config"].rsplit("-", 1)[-1] if cp > 1 else "ulysses"}
        runs.append({"label": f"{r['kind']} {r['config']} {r.get('model', '')}".strip(), "model": keys,
                     "folder": folder, "seq_len": r["seq_len"], "samples": int(r["tokens_per_step"] // r["seq_len"]),
                     "gpus": r["devices"], "peak": r.get("peak_memory_gib"),
                     "device": r.get("device_memory_gib", 139.8), "head_recomputed": "lm_head" not in r})
    return runs


def trainer_config(folder: Path, keys: dict, seq_len: int, samples: int):
    from prime_core.config.checks import schema_for

    return schema_for("trainer")(model={"name": str(folder), "dtype": "bfloat16", **keys}, seq_len=seq_len,
                                 data={"fake": {"batch_size": samples, "length": "fixed"}})


def compare(models: Path) -> list[dict]:
    """Every recorded run with its prediction (GiB) and relative error."""
    from prime_core.memory import GIB
    from prime_core.plan import predict

    rows = []
    for run in recorded_runs(models):
        with _head_as_run(run):
            prediction = predict(trainer_config(run["folder"], run["model"], run["seq_len"], run["samples"]),
                                 "trainer", processes=run["gpus"])
        error = None if run["peak"] is None else prediction.peak / GIB / run["peak"] - 1
        rows.append({**run, "predicted": prediction.peak / GIB, "needs": prediction.needs() / GIB,
                     "phase": prediction.phase, "error": error})
    return rows


@contextlib.contextmanager
def _head_as_run(run: dict):
    """Rows recorded before the fused LM head kept small logits for its backward (stop 47; newer
    rows record the ``lm_head`` they ran) are predicted as that code ran: recomputing them."""
    from prime_plugin_fused_lm_head import chunking

    budget = chunking.KEEP_BUDGET_BYTES
    chunking.KEEP_BUDGET_BYTES = 0 if run["head_recomputed"] else budget
    try:
        yield
    finally:
        chunking.KEEP_BUDGET_BYTES = budget


def comparison_table(rows: list[dict]) -> str:
    lines = [f"{'run':<58}{'GPUs':>5}{'tokens':>8}{'measured':>10}{'predicted':>11}{'error':>8}  phase"]
    lines += [f"{r['label']:<58}{r['gpus']:>5}{r['seq_len']:>8}"
              + (f"{r['peak']:>10.1f}{r['predicted']:>11.1f}{100 * r['error']:>+7.1f}%" if r["error"] is not None
                 else f"{'OOM':>10}{r['predicted']:>11.1f}{'':>8}") + f"  {r['phase']}"
              for r in rows]
    return "\n".join(lines)


QWEN3_30B_RECIPES = {
    "default": {},
    "ac": {"ac": {"freq": 1}},
    "memory-tight": "MEMORY_TIGHT",
}


def qwen3_30b(models: Path, seq_len: int = 8192) -> str:
    """Per-GPU terms of Qwen3-30B-A3B's shape on 8 GPUs, one ``seq_len`` sample per
    data-parallel group and step, at ep 4 and ep 8: with the experts replicated over
    ``dp_mod_ep`` as before (their shards undone to the EP split) and FSDP-sharded over it."""
    from prime_core.memory import GIB, evaluate
    from prime_core.plan import estimate

    parallel = bench_module("parallel_bench")
    folder = model_folder(models / "qwen3-30b-a3b", parallel.model_shape("moe", "qwen3-30b-a3b", None, False), True)
    out = []
    for recipe, extra in QWEN3_30B_RECIPES.items():
        extra = dict(parallel.MEMORY_TIGHT, cp_style="ulysses") if extra == "MEMORY_TIGHT" else extra
        columns = {}
        for ep in (4, 8):
            keys = {"impl": "custom", **parallel.PINNED, "ep": ep, **extra}
            config = trainer_config(folder, keys, seq_len, 8 // keys.get("cp", 1))
            for replicated in (True, False):
                est = estimate(config, "trainer", processes=8)
                if replicated:
                    for param in est.params.values():
                        if param.dim == "ep":
                            param.shards = est.degrees["ep"]
                columns[f"ep {ep}, experts {'replicated' if replicated else 'sharded'}"] = evaluate(est)
        names = list(dict.fromkeys(k for p in columns.values() for k, v in p.terms.items() if v))
        out.append(f"\n{recipe} ({', '.join(f'{k} = {v}' for k, v in extra.items()) or 'fp32 master, no AC'}), "
                   f"{seq_len} tokens per row, GiB per GPU")
        out.append(f"{'':<40}" + "".join(f"{c:>26}" for c in columns))
        for name in names:
            out.append(f"{name:<40}" + "".join(f"{p.terms.get(name, 0.0) / GIB:>26.1f}" for p in columns.values()))
        out.append(f"{'host memory':<40}" + "".join(f"{sum(p.cpu.values()) / GIB:>26.1f}" for p in columns.values()))
        out.append(f"{'peak':<40}" + "".join(f"{p.peak / GIB:>19.1f} ({p.phase[:3]})" for p in columns.values()))
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("compare", "qwen3-30b"))
    parser.add_argument("--seq-len", type=int, default=8192, help="qwen3-30b: tokens per row")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as models:
        if args.mode == "compare":
            rows = compare(Path(models))
            print(comparison_table(rows))
            single = [r for r in rows if r["gpus"] == 1 and r["error"] is not None]
            worst = max(single, key=lambda r: abs(r["error"]))
            print(f"worst single-GPU error: {100 * worst['error']:+.1f}% ({worst['label']}, {worst['seq_len']} tokens)")
        else:
            print(qwen3_30b(Path(models), args.seq_len))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
