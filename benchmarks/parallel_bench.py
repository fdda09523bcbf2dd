#!/usr/bin/env python3
"""Expert and context parallelism on the GPU machine, through the same code as
``prime trainer --bench`` (the core's build order, FSDP2, bf16 compute, fp32 master weights,
AdamW, the RL loss on fake samples).

    # a Qwen3-MoE-shaped model of a few billion parameters, EP against plain FSDP on the same GPUs
    torchrun --nproc-per-node 4 benchmarks/parallel_bench.py moe --ep 4 --seq-len 8192 --out $OUT
    torchrun --nproc-per-node 4 benchmarks/parallel_bench.py moe --ep 1 --seq-len 8192 --out $OUT
    # a Qwen3-1.7B-shaped model, context parallel: tokens/s per length, stopping at the first OOM
    torchrun --nproc-per-node 4 benchmarks/parallel_bench.py cp --cp 4 --style ulysses \
        --seq-lens 32768 65536 131072 --out $OUT
    python3 benchmarks/parallel_bench.py table --out $OUT

Models are random-weight checkpoints written once (rank 0) under ``--model-root``. For MoE runs
the share of the step the GPU spends in expert all-to-all kernels (dispatch and combine,
forward and backward) is read from a profiled step. Results: JSON lines in
``OUT/parallel.jsonl``. ``--tiny`` shrinks every model for a CPU smoke test.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

MOE = dict(hidden_size=2048, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
           intermediate_size=6144, moe_intermediate_size=768, num_experts=64, num_experts_per_tok=8,
           vocab_size=151936, tie_word_embeddings=True, rope_theta=1_000_000.0, max_position_embeddings=262144,
           rms_norm_eps=1e-6, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
DENSE = dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
             intermediate_size=6144, vocab_size=151936, tie_word_embeddings=True, rope_theta=1_000_000.0,
             max_position_embeddings=262144, rms_norm_eps=1e-6)
# Qwen3-30B-A3B's shape (48 layers, 128 experts of 768, top 8): about 30.5B parameters, 3.3B
# active. ``--layers`` keeps its layer shape and takes fewer of them (16 layers: about 10.3B).
QWEN3_30B_A3B = dict(MOE, num_hidden_layers=48, num_experts=128)
SHAPES = {"moe": MOE, "qwen3-30b-a3b": QWEN3_30B_A3B}
# The seeds' memory-tight recipe ("fitting large MoE on limited GPUs"), as written there; ep
# comes from --ep.
MEMORY_TIGHT = {"fused_lm_head_token_chunk_size": 1024, "cp": 2, "optim_cpu_offload": True, "compile": {},
                "ac": {"freq": 1}, "ac_offloading": {"max_inflight_activations": 1}}
PINNED = {"attn": "sdpa", "compile": False, "fused_lm_head_token_chunk_size": "disabled"}
"""What the recorded runs computed with before the trainer decided these keys itself on GPUs
(``prime_core.trainer.defaults``); ``--recipe fast-defaults`` leaves them to the trainer."""
BF16_MASTER = {"optimization_dtype": "bfloat16", "reduce_dtype": "bfloat16"}
"""``--recipe fast-bf16``: weights, gradients and AdamW state in bf16, no float32 master copy."""
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            intermediate_size=128, moe_intermediate_size=32, vocab_size=512)


def model_shape(kind: str, name: str, layers: int | None, tiny: bool) -> dict:
    shape = {**(SHAPES[name] if kind == "moe" else DENSE)}
    if layers:
        shape["num_hidden_layers"] = layers
    if tiny:
        shape.update(TINY, num_experts=min(shape.get("num_experts", 8), 16))
    if kind != "moe":
        shape = {k: v for k, v in shape.items() if k != "moe_intermediate_size"}
    return shape


BALANCED_QK_NORM = 4.0
"""``--routing balanced``: the weight of every query and key norm (transformers initialises them
to 1): attention logits 16x the variance."""


def expert_loads(model, input_ids) -> list[tuple[int, int]]:
    """Each MoE layer's fewest and most token copies per expert on ``input_ids`` (an even share
    is ``tokens * top_k / experts``)."""
    import torch

    loads = []

    def count(mlp, args):
        x = args[0].reshape(-1, args[0].shape[-1])
        chosen = (x.float() @ mlp.gate.weight.float().t()).topk(mlp.gate.top_k, -1).indices.reshape(-1)
        counts = torch.bincount(chosen, minlength=mlp.gate.weight.shape[0])
        loads.append((int(counts.min()), int(counts.max())))

    hooks = [layer.mlp.register_forward_pre_hook(count) for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    try:
        with torch.no_grad():
            model(input_ids=input_ids)
    finally:
        for hook in hooks:
            hook.remove()
    return loads


def make_model(folder: Path, kind: str, shape: dict, world, routing: str = "random") -> Path:
    """Write the random checkpoint on rank 0 (once); every rank waits for it.

    An MoE's routing at random weights collapses: Qwen3's query and key norms give attention
    logits of about unit variance, so each random attention layer averages thousands of tokens
    and the hidden states grow alike. From the third layer on the routers then pick the same
    experts for nearly every token (in the 2.9B shape about 8 of the 64 experts took up to 8,190
    of 8,192 tokens, the others none). A K-grouped weight gradient runs 0.57-0.93x as fast there
    as on an even routing, but the other expert GEMMs run faster there than on the balanced one
    below, and the whole step runs within 0.6% of it (stop 52). A trained model attends sharply
    and routes close to evenly (its load-balancing loss sees to it). ``routing = "balanced"`` sets
    the query and key norms' weights to ``BALANCED_QK_NORM``: attention stays sharp, the tokens
    distinct, and the random routers route them about evenly (on the H200 every layer's most
    loaded expert took at most 1.5x an even share). Each layer's loads are printed either way."""
    from prime_core import distributed

    if world.main and not (folder / "config.json").exists():
        import torch
        from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

        config, family = ((Qwen3MoeConfig(**shape), Qwen3MoeForCausalLM) if kind == "moe"
                          else (Qwen3Config(**shape), Qwen3ForCausalLM))
        torch.manual_seed(0)
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)  # built in bf16 at once: tens of billions fit one GPU so
        try:
            with torch.device(world.device):
                model = family(config)
        finally:
            torch.set_default_dtype(default)
        if routing == "balanced":
            with torch.no_grad():
                for layer in model.model.layers:
                    layer.self_attn.q_norm.weight.fill_(BALANCED_QK_NORM)
                    layer.self_attn.k_norm.weight.fill_(BALANCED_QK_NORM)
        if kind == "moe":
            import random

            rng = random.Random(0)
            ids = torch.tensor([[rng.randrange(shape["vocab_size"]) for _ in range(8192)]], device=world.device)
            print(f"{routing} routing: each layer's fewest and most token copies an expert took, of "
                  f"{8192 * shape['num_experts_per_tok']} over {shape['num_experts']} experts: "
                  f"{expert_loads(model, ids)}", flush=True)
        model.save_pretrained(folder, safe_serialization=True)
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    distributed.barrier(world)
    return folder


def profiled_step(training, batch, loss_fn, stacks: bool = False, pipelined: bool = False):
    """One step under the profiler (CPU operators with their shapes, GPU kernels; with
    ``stacks``, the Python calls too); ``pipelined``: three, each queued before the one before
    is read."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from prime_core.trainer.step import queue_train_step

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True,
                 with_stack=stacks) as prof:
        pending = None
        for _ in range(3 if pipelined else 1):
            read = queue_train_step(training, batch["micro_batches"], max_norm=1.0, loss_fn=loss_fn)
            if pending:
                pending()
            pending = read
        pending()
        torch.cuda.synchronize()
    return prof


def gpu_events(prof) -> list:
    return [e for e in prof.key_averages() if "CUDA" in str(getattr(e, "device_type", ""))]


def all_to_all_share(prof) -> float:
    """GPU time in all-to-all (send/recv) kernels over the whole GPU time of one step."""
    total = comm = 0.0
    for event in gpu_events(prof):
        time_us = getattr(event, "device_time_total", 0.0)
        total += time_us
        if "nccl" in event.key.lower() and ("SendRecv" in event.key or "AllToAll" in event.key):
            comm += time_us
    return comm / total if total else 0.0


def kernel_table(prof, rows: int = 40) -> str:
    """The step's GPU kernels by total time (share, calls, milliseconds, name), then the
    operators that launched them, by their own GPU time, with their input shapes."""
    events = sorted(gpu_events(prof), key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events) or 1.0
    lines = [f"GPU time {total / 1e3:.1f} ms in {len(events)} kernels"]
    lines += [f"{100 * e.device_time_total / total:5.1f}% {e.count:6d} {e.device_time_total / 1e3:9.2f} ms  "
              f"{e.key[:150]}" for e in events[:rows]]
    ops = [e for e in prof.key_averages(group_by_input_shape=True)
           if "CUDA" not in str(getattr(e, "device_type", "")) and e.self_device_time_total > 0]
    ops.sort(key=lambda e: -e.self_device_time_total)
    lines.append("operators by their own GPU time:")
    lines += [f"{100 * e.self_device_time_total / total:5.1f}% {e.count:6d} {e.self_device_time_total / 1e3:9.2f} ms  "
              f"{e.key} {str(e.input_shapes)[:120]}" for e in ops[:rows]]
    return "\n".join(lines + idle_table(prof))


SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
"""CUDA runtime calls where the host waits for the GPU (``cudaMemcpy``: the blocking copy).
Any other runtime call of over ``SLOW_CALL_US`` is listed with them: a copy from pageable
memory, an allocation or a free can wait for the GPU too."""
SLOW_CALL_US = 300


def project_frames(op, count: int = 8) -> list[str]:
    """With ``--trace`` (Python stacks recorded): ``op``'s frames outside torch, innermost first."""
    stack = getattr(op, "stack", None) or []
    return [f for f in stack if "site-packages/torch" not in f and "<built-in" not in f][:count]


def idle_table(prof, rows: int = 25) -> list[str]:
    """Where the GPU waits for the host in the profiled step: its idle time between the first
    and last kernel, by what the host was doing (``host_during``), and the longest gaps."""
    import bisect
    from collections import defaultdict

    events = list(prof.events())
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                     if "CUDA" in str(e.device_type) and e.time_range.end > e.time_range.start)
    if not kernels:
        return []
    host = [e for e in events if "CPU" in str(e.device_type)]
    gaps, end = [], kernels[0][1]
    for start, stop, name in kernels[1:]:
        if start - end > 5:  # microseconds; shorter ones are launch latency
            gaps.append((start - end, end, start, name))
        end = max(end, stop)
    window = end - kernels[0][0]

    ops = sorted((e for e in host if not str(e.name).startswith(("cuda", "cu"))), key=lambda e: e.time_range.start)
    starts = [e.time_range.start for e in ops]

    def host_during(t0, t1):
        """The longest host operator that began in the gap (what kept the host from launching),
        else the last one that began before it; CUDA runtime calls are not operators."""
        lo, hi = bisect.bisect_left(starts, t0), bisect.bisect_right(starts, t1)
        if hi > lo:
            return max(ops[lo:hi], key=lambda e: e.time_range.end - e.time_range.start).name
        return ops[lo - 1].name if lo else "?"

    def inside(t0, t1, count=8):
        """The host operators that ran in the gap, by how much of it each covers (nested ones too)."""
        overlap = [(min(e.time_range.end, t1) - max(e.time_range.start, t0), e.name)
                   for e in ops[:bisect.bisect_right(starts, t1)] if e.time_range.end > t0]
        return [f"{o / 1e3:.2f} {name[:60]}" for o, name in sorted(overlap, reverse=True)[:count] if o > 0]

    by_op: dict = defaultdict(lambda: [0.0, 0])
    described = []
    for gap in sorted(gaps, reverse=True):
        name = host_during(gap[1], gap[2])
        by_op[name][0] += gap[0]
        by_op[name][1] += 1
        if len(described) < rows:
            described.append(f"{gap[0] / 1e3:8.2f} ms  before {gap[3][:70]}  host in {name[:80]}")
            if len(described) <= 5:  # the longest: what the host ran meanwhile (ms of the gap, operator)
                described.append("           during: " + "; ".join(inside(gap[1], gap[2])))
                last = ops[bisect.bisect_right(starts, gap[2]) - 1]  # what the host was in as the GPU ran dry
                described += ["           " + frame for frame in project_frames(last)]
    idle = sum(g[0] for g in gaps)
    syncs = sorted((e for e in host if str(e.name) in SYNCS or (
        str(e.name).startswith("cuda") and e.time_range.end - e.time_range.start > SLOW_CALL_US)),
        key=lambda e: e.time_range.start)
    waited = sum(e.time_range.end - e.time_range.start for e in syncs) / 1e3
    lines = [f"host waits on the GPU: {len(syncs)} calls, {waited:.2f} ms"]
    for sync in syncs[:10]:  # the operator each wait happened in, and its Python frames (--trace)
        around = [e for e in ops[:bisect.bisect_right(starts, sync.time_range.start)]
                  if e.time_range.end >= sync.time_range.end]
        op = min(around, key=lambda e: e.time_range.end - e.time_range.start) if around else None
        lines.append(f"    {(sync.time_range.end - sync.time_range.start) / 1e3:.2f} ms {sync.name} in "
                     f"{op.name[:80] if op else '?'}")
        lines += ["        " + f for f in project_frames(op)]
    lines += [f"GPU idle {idle / 1e3:.1f} ms of {window / 1e3:.1f} ms between the step's first and last kernel "
             f"({len(gaps)} gaps over 5 us); by what the host was doing:"]
    ranked = sorted(by_op.items(), key=lambda kv: -kv[1][0])[:rows]
    lines += [f"{total / 1e3:9.2f} ms {count:5d}  {name[:120]}" for name, (total, count) in ranked]
    return lines + ["the longest gaps:"] + described


def run_keys(args, kind: str, name: str, routing: str, folder: Path) -> tuple[dict, dict]:
    """``trainer.model`` for the run, and the label its rows carry."""
    import torch

    model = {"name": str(folder), "impl": "custom", "dtype": "bfloat16" if torch.cuda.is_available() else "float32"}
    if not args.recipe.startswith("fast-"):
        model.update(PINNED)
    if args.recipe == "fast-bf16":
        model.update(BF16_MASTER)
    if kind == "moe":
        if args.recipe == "memory-tight":
            model.update(MEMORY_TIGHT, cp_style=args.style)
        model.update(ep=args.ep)
        label = {"kind": "moe", "model": name + ("-balanced" if routing == "balanced" else ""),
                 "config": (f"ep{args.ep}" if args.ep > 1 else "fsdp")
                 + {"memory-tight": "-tight", "fast-defaults": "-defaults", "fast-bf16": "-bf16"}.get(args.recipe, "")}
    else:
        model.update(cp=args.cp, cp_style=args.style, ac={"freq": 1})
        label = {"kind": "cp", "config": (f"cp{args.cp}-{args.style}" if args.cp > 1 else "cp1")
                 + ("-defaults" if args.recipe == "fast-defaults" else "")}
    if args.attn:
        model["attn"] = label["attn"] = args.attn
    if args.length == "variable":
        label["length"] = "variable"
    return model, label


def worker(args) -> int:
    import random

    import torch

    from prime_core import distributed
    from prime_core.bench import BenchConfig, BenchMeter
    from prime_core.config.checks import schema_for
    from prime_core.memory import GIB
    from prime_core.plan import predict
    from prime_core.plugins import get_plugin_manager
    from prime_core.trainer.build import start_training
    from prime_core.trainer.fake import FakeDataConfig

    world = distributed.init()
    kind = args.mode
    shape = model_shape(kind, args.shape, args.layers, args.tiny)
    name = kind if kind == "cp" else args.shape + (f"-{args.layers}l" if args.layers else "")
    routing = args.routing if kind == "moe" else "random"
    suffix = ("-balanced" if routing == "balanced" else "") + ("-tiny" if args.tiny else "")
    folder = make_model(args.model_root / f"{name}{suffix}", kind, shape, world, routing)
    model, label = run_keys(args, kind, name, routing, folder)
    seq_lens = args.seq_lens
    config = schema_for("trainer")(model=model, optim={"lr": 1e-6}, output_dir=args.out / "run", seq_len=max(seq_lens))
    manager = get_plugin_manager()
    loss_fn = manager.select("algorithms", "loss:default").fn
    started = time.perf_counter()
    training = start_training(config, "trainer", max_steps=None, seed=0, manager=manager)
    build_s = time.perf_counter() - started
    # The trainer's world carries the meshes (the one from init() above does not): CP groups
    # share rows, so samples and token counts go by data-parallel group.
    world = training.world
    groups = world.size // world.rows_split
    for seq_len in seq_lens:
        bench = BenchConfig(warmup_steps=args.warmup, steps=args.steps)
        meter = BenchMeter(bench, world=world, model=training.policy.model, hf_config=training.policy.hf_config,
                           dtype=model["dtype"], label={**label, "seq_len": seq_len}, pipelined=args.pipelined)
        fake = FakeDataConfig(batch_size=args.samples_per_group * groups, length=args.length)
        rng = random.Random(0)
        plan = predict(config, "trainer", processes=world.size, rows=args.samples_per_group, seq_len=seq_len)
        record = {**label, "seq_len": seq_len, "build_s": build_s, "devices": world.size,
                  "params": round(sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2),  # bf16
                  "predicted_peak_gib": plan.peak / GIB, "lm_head": plan.lm_head}
        try:
            batch = meter.run_fake_steps(training, fake, seq_len, rng, loss_fn=loss_fn, max_norm=1.0)
            record.update(meter.result())
            if torch.cuda.is_available() and (args.profile or (kind == "moe" and args.ep > 1)):
                prof = profiled_step(training, batch, loss_fn, stacks=args.trace, pipelined=args.pipelined)
                if kind == "moe" and args.ep > 1:
                    record["all_to_all_share"] = all_to_all_share(prof)
                if args.profile and world.main:
                    text = kernel_table(prof)
                    (args.out / f"profile-{label['config']}-{seq_len}.txt").write_text(text + "\n")
                    print(text, flush=True)
                    if args.trace:  # for chrome://tracing or Perfetto
                        import gzip

                        trace = args.out / f"trace-{label['config']}-{seq_len}.json"
                        prof.export_chrome_trace(str(trace))
                        with open(trace, "rb") as f, gzip.open(f"{trace}.gz", "wb") as z:
                            z.write(f.read())
                        trace.unlink()
        except torch.OutOfMemoryError:
            record.update({"oom": True})
            training.optimizer.zero_grad(set_to_none=True)
        if world.main:
            with open(args.out / "parallel.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            shown = "OOM" if record.get("oom") else (
                f"{record['tokens_per_s']:,.0f} tok/s, MFU {100 * record['mfu']:.1f} %, "
                f"peak {record['peak_memory_gib']:.1f} GiB (prime plan: {record['predicted_peak_gib']:.1f})"
                + (f", all-to-all {100 * record['all_to_all_share']:.1f} % of GPU time"
                   if "all_to_all_share" in record else "")
                + (f", GPU clock {record['gpu_clock_mhz_mean']:,.0f} MHz (power-capped "
                   f"{100 * record['gpu_power_capped_share']:.0f} %)" if "gpu_clock_mhz_mean" in record else ""))
            print(f"{label['kind']} {label.get('model', '')} ({record['params'] / 1e9:.1f}B) {label['config']} "
                  f"seq {seq_len} on {world.size}{', pipelined' if args.pipelined else ''}: {shown}", flush=True)
        import gc

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if record.get("oom"):
            break
    distributed.shutdown()
    return 0


def table(out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    rows = [json.loads(line) for line in (out / "parallel.jsonl").read_text().splitlines() if line.strip()]
    grid = Table(title="expert and context parallelism")
    for column in ("kind", "config", "GPUs", "seq", "tok/s", "tok/s/GPU", "MFU", "peak GiB", "all-to-all"):
        grid.add_column(column, justify="right")
    for r in rows:
        if r.get("oom"):
            grid.add_row(r["kind"], r["config"], str(r["devices"]), str(r["seq_len"]), "OOM", "", "", "", "")
            continue
        share = f"{100 * r['all_to_all_share']:.1f} %" if "all_to_all_share" in r else ""
        grid.add_row(r["kind"], r["config"], str(r["devices"]), str(r["seq_len"]), f"{r['tokens_per_s']:,.0f}",
                     f"{r['tokens_per_s'] / r['devices']:,.0f}", f"{100 * r['mfu']:.1f} %",
                     f"{r['peak_memory_gib']:.1f}", share)
    Console(width=140).print(grid)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("moe", "cp", "table"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model-root", type=Path,
                        default=Path(os.environ.get("TMPDIR", "/tmp")) / "prime-bench-models")
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--shape", choices=tuple(SHAPES), default="moe", help="moe: the MoE model's shape")
    parser.add_argument("--layers", type=int, help="moe: this many layers of the shape")
    parser.add_argument("--recipe", choices=("default", "memory-tight", "fast-defaults", "fast-bf16"),
                        default="default",
                        help="moe: the config the recorded runs used (FSDP + EP, vanilla LM head, no compile), the "
                             "seeds' memory-tight recipe on top, what the trainer picks itself on GPUs now, or that "
                             "with bf16 master weights and AdamW state (the plain HF step's precision)")
    parser.add_argument("--routing", choices=("random", "balanced"), default="random",
                        help="moe: the random weights' routing (collapsed onto a few experts from the third "
                             "layer on), or an even one, as a trained model's (make_model)")
    parser.add_argument("--attn", help="trainer.model.attn for every recipe (e.g. flash_attention_4); default: the "
                                       "recipe's")
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--style", choices=("ring", "ulysses"), default="ulysses")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192])
    parser.add_argument("--samples-per-group", type=int, default=1, help="samples per data-parallel group and step")
    parser.add_argument("--length", choices=("fixed", "variable"), default="fixed",
                        help="variable: each sample 8 to seq_len tokens, packed into rows (an RL step's rows)")
    parser.add_argument("--pipelined", action="store_true",
                        help="queue each step before reading the one before (prime sft's loop); otherwise each step "
                             "is read before the next starts (prime trainer's, which publishes every step's weights)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="a small model: smoke test on a CPU")
    parser.add_argument("--trace", action="store_true",
                        help="with --profile: record the Python calls too, and write the profiled step's "
                             "trace (trace-<config>-<seq>.json.gz)")
    parser.add_argument("--profile", action="store_true",
                        help="after the measured steps, profile one more and print its GPU kernels by time, "
                             "then the GPU's idle time by what the host was doing (also written to "
                             "profile-<config>-<seq>.txt)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.mode == "table":
        table(args.out)
        return 0
    return worker(args)


if __name__ == "__main__":
    from prime_core.distributed import exit_process

    exit_process(main())
