#!/usr/bin/env python3
"""prime's trainer on a Qwen3-1.7B-shaped model (random weights, vocabulary 151,936): tokens/s,
MFU and peak memory per memory knob and sequence length, beside the plain Hugging Face step
(``hf_baseline.py``) measured in the same job.

    python3 benchmarks/trainer_memory.py knobs   --seq-lens 4096 8192 16384 32768 --out $OUT
    python3 benchmarks/trainer_memory.py longest --seq-lens 32768 49152 65536 81920 --out $OUT
    torchrun --nproc-per-node 2 benchmarks/trainer_memory.py scaling --seq-len 8192 --out $OUT
    python3 benchmarks/trainer_memory.py knobs --kind rl16 --samples-per-rank 16 --seq-lens 8192 \
        --knobs default optim_cpu_offload --out $OUT     # an RL-sized step: 16 samples
    python3 benchmarks/trainer_memory.py knobs --knobs custom_ac_fast --length variable --samples-per-rank 8 \
        --seq-lens 32768 --out $OUT                      # packed rows: 8 samples of 8 to 32,768 tokens
    TORCH_LOGS=recompiles python3 benchmarks/trainer_memory.py knobs --knobs fast_defaults --length variable \
        --samples-per-rank 4 --seq-lens 8192 --warmup 5 --steps 8 --out $OUT   # an RL step's rows under compile
    python3 benchmarks/trainer_memory.py profile --seq-len 4096 --out $OUT   # where a step's time goes
    python3 benchmarks/trainer_memory.py profile --memory --knob custom_ac_chunk --seq-len 131072 --out $OUT
    python3 benchmarks/trainer_memory.py profile --length variable --samples-per-rank 4 --warmup 5 --steps 10 \
        --knob custom_fp8_cached_compile --attn torch_fused --out $OUT   # RL rows, once their lengths are seen
    python3 benchmarks/trainer_memory.py table --out $OUT

Each knob runs in its own process (a clean allocator), through the same code as
``prime trainer --bench``: the core's build order, FSDP2 on one GPU (bf16 compute, fp32 master
weights, fp32 AdamW state), the RL loss on fake fixed-length samples (one sample per step unless told, one
step = ``warmup`` + ``steps`` optimizer steps), MFU and peak memory from ``prime_core.bench``.
Results are JSON lines in ``OUT/results.jsonl`` (with each step's loss and token count, so that
knobs run on the same batches can be compared); ``table`` prints them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

QWEN3_1_7B = dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, intermediate_size=6144, vocab_size=151936, tie_word_embeddings=True,
                  rope_theta=1_000_000.0, max_position_embeddings=131072, rms_norm_eps=1e-6)

PINNED = {"attn": "sdpa", "compile": False, "fused_lm_head_token_chunk_size": "disabled"}
"""What the knobs below were measured with before the trainer decided these keys itself on
GPUs (``prime_core.trainer.defaults``): every knob starts from it, so that its name keeps
meaning what ``results/`` recorded; ``fast_defaults`` leaves them to the trainer."""
UNPINNED = {"attn": "auto", "compile": "auto", "fused_lm_head_token_chunk_size": None}

KNOBS = {
    "default": {},
    # what a user gets with no performance key set: the native model (impl = "auto" picks it),
    # and on a GPU the trainer's own choices (fused attention, fused LM head, compile)
    "fast_defaults": {"impl": "auto", **UNPINNED},
    "ac": {"ac": {"freq": 1}},
    "ac_selective": {"ac": {"mode": "selective", "targets": ["norm", "attn_proj"]}},
    "ac_offloading": {"ac": {"freq": 1}, "ac_offloading": {"max_inflight_activations": 5}},
    "optim_cpu_offload": {"optim_cpu_offload": True},
    "fsdp_cpu_offload": {"fsdp_cpu_offload": True},
    "compile": {"compile": {}},
    # The native model (prime-plugin-custom) with the fused LM head (Triton on CUDA), then with
    # the other speed and memory knobs on top: the candidates for "our best configuration".
    "custom": {"impl": "custom", "fused_lm_head_token_chunk_size": "auto"},
    "custom_compile": {"impl": "custom", "fused_lm_head_token_chunk_size": "auto", "compile": {}},
    "custom_compile_fused": {"impl": "custom", "fused_lm_head_token_chunk_size": "auto", "compile": {},
                             "attn": "torch_fused"},
    # one GPU: the bf16 copies of the weights held from forward to backward (no resharding)
    "custom_fast": {"impl": "custom", "fused_lm_head_token_chunk_size": "auto", "compile": {},
                    "attn": "torch_fused", "reshard_after_forward": False},
    # the baseline's precision: bf16 weights, gradients and AdamW state (no fp32 master copy)
    "custom_fast_bf16": {"impl": "custom", "fused_lm_head_token_chunk_size": "auto", "compile": {},
                         "attn": "torch_fused", "reshard_after_forward": False, "optimization_dtype": "bfloat16",
                         "reduce_dtype": "bfloat16"},
    "custom_ac_fast": {"impl": "custom", "fused_lm_head_token_chunk_size": "auto", "compile": {}, "ac": {"freq": 1},
                       "attn": "torch_fused"},
    # AC's block inputs in pinned host memory (copied on a side stream, two in flight)
    "custom_ac_offload": {"impl": "custom", "fused_lm_head_token_chunk_size": "auto", "compile": {}, "ac": {"freq": 1},
                          "ac_offloading": {"max_inflight_activations": 2}, "attn": "torch_fused"},
    # the longest sequences: the dense MLP in chunks of 64k tokens (its intermediates one chunk at a time)
    "custom_ac_chunk": {"impl": "custom", "fused_lm_head_token_chunk_size": "auto", "compile": {},
                        "ac": {"freq": 1, "mlp_token_chunk_size": 65536}, "attn": "torch_fused"},
    # 1,048,576 tokens: the first 20 of 28 blocks' inputs in pinned host memory as well (all 28 would be
    # 112 GiB of host memory, more than the lent machine's 128 GiB leaves beside the process)
    "custom_ac_chunk_offload": {"impl": "custom", "fused_lm_head_token_chunk_size": "auto", "compile": {},
                                "ac": {"freq": 1, "mlp_token_chunk_size": 65536},
                                "ac_offloading": {"max_inflight_activations": 2, "blocks": 20}, "attn": "torch_fused"},
    # the weight gradient in FP8 too (the fp8 default until stop 58, which these rows were measured with);
    # both without the weight cache (the default since stop 67), as their rows were measured
    "custom_fp8_compile": {"impl": "custom", "fused_lm_head_token_chunk_size": "auto", "compile": {},
                           "quantization": "fp8", "fp8_wgrad": True, "fp8_weight_cache": False},
    "custom_fp8_bf16_wgrad_compile": {"impl": "custom", "fused_lm_head_token_chunk_size": "auto", "compile": {},
                                      "quantization": "fp8", "fp8_wgrad": False, "fp8_weight_cache": False},
    # the FP8 defaults: a step of several passes reuses each weight's blocks after its first
    "custom_fp8_cached_compile": {"impl": "custom", "fused_lm_head_token_chunk_size": "auto", "compile": {},
                                  "quantization": "fp8"},
    "custom_fp8_cached_compile_torch": {"impl": "custom", "fused_lm_head_token_chunk_size": "auto", "compile": {},
                                        "quantization": "fp8", "kernels": {"fp8_linear": "torch"}},
    "custom_ac": {"impl": "custom", "fused_lm_head_token_chunk_size": "auto", "ac": {"freq": 1}},
    "custom_ac_compile": {"impl": "custom", "fused_lm_head_token_chunk_size": "auto", "ac": {"freq": 1},
                          "compile": {}},
    "custom_lean": {"impl": "custom", "fused_lm_head_token_chunk_size": "auto", "ac": {"freq": 1},
                    "optim_cpu_offload": True},
}
ALL_KNOBS = {"ac": {"freq": 1}, "ac_offloading": {"max_inflight_activations": 1}, "optim_cpu_offload": True}


def model_keys(args) -> dict:
    """``trainer.model`` for ``--knob`` (``--attn`` replacing its attention kernel)."""
    knob = ALL_KNOBS if args.knob == "all" else KNOBS[args.knob]
    return {"name": str(args.model_dir), "impl": "hf", "dtype": "bfloat16", **PINNED, **knob,
            **({"attn": args.attn} if args.attn else {})}


def make_model(folder: Path) -> Path:
    """A random-weight Qwen3-1.7B-shaped checkpoint (bf16 safetensors), written once."""
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(**QWEN3_1_7B)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    del model
    return folder


def worker(args) -> int:
    """One knob in this process (or this torchrun job), every sequence length in turn."""
    import random

    import torch

    from prime_core import distributed
    from prime_core.bench import BenchConfig, BenchMeter
    from prime_core.config.checks import schema_for
    from prime_core.memory import GIB
    from prime_core.plugins import get_plugin_manager
    from prime_core.trainer.build import start_training
    from prime_core.trainer.fake import FakeDataConfig

    config = schema_for("trainer")(model=model_keys(args), optim={"lr": 1e-6}, output_dir=args.out / "run",
                                   seq_len=max(args.seq_lens))
    manager = get_plugin_manager()
    loss_fn = manager.select("algorithms", "loss:default").fn
    started = time.perf_counter()
    training = start_training(config, "trainer", max_steps=None, seed=0, manager=manager)
    world = training.world
    build_s = time.perf_counter() - started
    per_rank = args.samples_per_rank
    for seq_len in args.seq_lens:
        bench = BenchConfig(warmup_steps=args.warmup, steps=args.steps)
        meter = BenchMeter(bench, world=world, model=training.policy.model, hf_config=training.policy.hf_config,
                           dtype="bfloat16", label={"config": args.knob, "seq_len": seq_len})
        fake = FakeDataConfig(batch_size=per_rank * world.size, length=args.length)
        rng = random.Random(0)
        plan = planned(config, world, seq_len, per_rank)
        record = {"kind": args.kind, "config": args.knob, "seq_len": seq_len, "length": args.length, "build_s": build_s,
                  "predicted_peak_gib": plan.peak / GIB, "lm_head": plan.lm_head,
                  **({"attn": args.attn} if args.attn else {})}
        seen = []  # each step's sums: the trainer's loss (as logged), to compare knobs on the same batches
        try:
            meter.run_fake_steps(training, fake, seq_len, rng, loss_fn=loss_fn, max_norm=1.0,
                                 on_step=lambda _step, sums, seen=seen: seen.append(sums))
            record.update(meter.result(), losses=[s["loss"] for s in seen],
                          step_tokens=[int(s["tokens"]) for s in seen])
        except torch.OutOfMemoryError:
            record.update({"oom": True, "devices": world.size})
            training.optimizer.zero_grad(set_to_none=True)
        if world.main:
            with open(args.out / "results.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            shown = "OOM" if record.get("oom") else (
                f"{record['tokens_per_s']:,.0f} tok/s, MFU {100 * record['mfu']:.1f} %, "
                f"peak {record['peak_memory_gib']:.1f} GiB (prime plan: {record['predicted_peak_gib']:.1f})")
            print(f"{args.kind} {args.knob}{'+' + args.attn if args.attn else ''} seq {seq_len}: {shown}", flush=True)
        import gc

        gc.collect()
        torch.cuda.empty_cache()
        if record.get("oom") and args.stop_at_oom:
            break
    distributed.shutdown()
    return 0


def planned(config, world, seq_len: int, samples_per_rank: int):
    """``prime plan``'s prediction for this run, recorded beside the measured peak (with the LM
    head it runs, which ``memory_plan.py compare`` reads back)."""
    from prime_core.plan import predict

    return predict(config, "trainer", processes=world.size, rows=samples_per_rank, seq_len=seq_len)


def profile(args) -> int:
    """Where one default step's time goes at ``--seq-len``: forward+backward, clipping and the
    optimizer timed apart, then the profiler's top operators."""
    import random

    from prime_core import distributed
    from prime_core.bench import synchronize
    from prime_core.config.checks import schema_for
    from prime_core.plugins import get_plugin_manager
    from prime_core.trainer.build import start_training
    from prime_core.trainer.fake import FakeDataConfig, fake_batch
    from prime_core.trainer.optim import clip_and_step
    from prime_core.trainer.step import forward_backward

    config = schema_for("trainer")(model=model_keys(args), optim={"lr": 1e-6}, output_dir=args.out / "run",
                                   seq_len=args.seq_len)
    manager = get_plugin_manager()
    loss_fn = manager.select("algorithms", "loss:default").fn
    training = start_training(config, "trainer", max_steps=None, seed=0, manager=manager)
    model, world = training.policy.model, training.world
    rng = random.Random(0)
    fake = FakeDataConfig(batch_size=1)

    def step(times=None):
        rows = fake_batch(fake, args.seq_len, training.policy.hf_config.vocab_size, rng)["micro_batches"]
        marks = [time.perf_counter()]
        forward_backward(model, rows, total_loss_tokens=sum(sum(r["loss_mask"]) for r in rows), world=world,
                         loss_fn=loss_fn, before_backward=training.policy.before_backward)
        for hook in training.policy.before_step:  # as train_step
            hook(model)
        synchronize(world.device)
        marks.append(time.perf_counter())
        clip_and_step(model, training.optimizer, training.scheduler, 1.0, update=training.policy.update)
        synchronize(world.device)
        marks.append(time.perf_counter())
        if times is not None:
            times.append([b - a for a, b in zip(marks, marks[1:], strict=False)])

    if args.length == "variable":
        return profile_rows(args, training, loss_fn)
    for _ in range(2):
        step()
    if args.memory:
        print(peak_breakdown(step, device=world.device), flush=True)
        distributed.shutdown()
        return 0
    times: list = []
    for _ in range(3):
        step(times)
    for name, column in zip(("forward+backward", "clip+optimizer"), zip(*times, strict=True), strict=True):
        print(f"profile {args.knob} seq {args.seq_len}: {name} {1000 * sum(column) / len(column):.1f} ms", flush=True)
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
    print(averages.table(sort_by="self_cuda_time_total", row_limit=30), flush=True)
    print(kernel_shares(averages), flush=True)
    if args.trace:
        import gzip

        trace = args.out / f"trace-{args.knob}-{args.seq_len}.json"
        prof.export_chrome_trace(str(trace))
        with open(trace, "rb") as raw, gzip.open(f"{trace}.gz", "wb") as packed:
            packed.write(raw.read())
        trace.unlink()
    distributed.shutdown()
    return 0


def profile_rows(args, training, loss_fn) -> int:
    """``profile --length variable``: the rows of ``knobs --length variable`` (the same batches:
    ``--samples-per-rank`` samples of 8 to ``--seq-len`` tokens packed a step, ``--warmup`` +
    ``--steps`` of them), each trained once (compiling, and JIT-compiling backends, at its new
    lengths), then the last ``--steps`` again: timed, then profiled. What a long run sees once
    its row lengths are no longer new, per step."""
    import gc
    import random
    import statistics

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from prime_core import distributed
    from prime_core.bench import synchronize
    from prime_core.trainer.fake import FakeDataConfig, fake_batch
    from prime_core.trainer.step import train_step

    vocab, device = training.policy.hf_config.vocab_size, training.world.device
    fake = FakeDataConfig(batch_size=args.samples_per_rank, length="variable")
    rng = random.Random(0)
    batches = [fake_batch(fake, args.seq_len, vocab, rng)["micro_batches"] for _ in range(args.warmup + args.steps)]

    def run(rows) -> float:
        started = time.perf_counter()
        train_step(training, rows, max_norm=1.0, loss_fn=loss_fn)
        synchronize(device)
        return time.perf_counter() - started

    first = [run(rows) for rows in batches]
    if args.gc == "off":  # what the collector holds by now is frozen, and it runs no more
        gc.collect()
        gc.freeze()
        gc.disable()
    again = [run(rows) for rows in batches[args.warmup:]]
    tokens = [sum(len(row["input_ids"]) for row in rows) for rows in batches[args.warmup:]]
    flags = [*args.set, *(["gc=off"] if args.gc == "off" else [])]
    label = f"profile {args.knob}{'+' + args.attn if args.attn else ''}{''.join(' ' + f for f in flags)} rows"
    print(f"{label}: first pass {sum(first):.1f} s ({max(first):.2f} s slowest); again: median "
          f"{1000 * statistics.median(again):.1f} ms, {sum(tokens) / sum(again):,.0f} tok/s over {len(again)} steps",
          flush=True)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for rows in batches[args.warmup:]:
            run(rows)
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cuda_time_total", row_limit=40), flush=True)
    print(averages.table(sort_by="self_cpu_time_total", row_limit=40), flush=True)
    print(f"{label}: GPU time of {len(again)} steps ({sum(tokens):,} tokens)", flush=True)
    print(kernel_shares(averages), flush=True)
    with open(args.out / "profiles.jsonl", "a") as f:
        f.write(json.dumps({"knob": args.knob, "attn": args.attn, "set": args.set, "gc": args.gc,
                            "seq_len": args.seq_len, "samples_per_rank": args.samples_per_rank, "first_s": first,
                            "again_s": again, "tokens": tokens}) + "\n")
    distributed.shutdown()
    return 0


def peak_breakdown(step, device, rows: int = 30) -> str:
    """What is allocated at the step's peak: ``step()`` run under the allocator's history, the
    history replayed to its largest moment, and the blocks alive then summed by where they were
    allocated (the innermost frame of prime's code, and the innermost Python frame). Blocks
    allocated before the step are counted as a whole in ``before``, even those freed during it."""
    import torch

    from prime_core.memory import GIB

    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(max_entries=4_000_000)
    # A checkpoint stops its recomputation early by raising an exception through the compiled
    # block; with the history recorded, autograd then failed with "returned NULL without setting
    # an exception" (stop 54). Recomputing the whole block costs its last ops and no memory at the peak.
    from torch.utils.checkpoint import set_checkpoint_early_stop

    with set_checkpoint_early_stop(False):
        step()
    torch.cuda.synchronize(device)
    snapshot = torch.cuda.memory._snapshot(device)
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][device.index or 0]

    def replay(stop=None):
        live, total, top, at = {}, 0, 0, 0
        for index, event in enumerate(trace[:stop]):
            if event["action"] == "alloc":
                live[event["addr"]] = event
                total += event["size"]
            elif event["action"] == "free_completed" and event["addr"] in live:
                total -= live.pop(event["addr"])["size"]
            if total > top:
                top, at = total, index + 1
        return live, top, at

    _, top, at = replay()
    live, _, _ = replay(at)

    def where(frames) -> str:
        python = [f for f in frames if f["filename"].endswith(".py")]  # the innermost frames are C++ (unwind)
        ours = next((f for f in python if "prime" in f["filename"] and "/benchmarks/" not in f["filename"]), None)
        if not python:
            return "(no Python frame: the autograd engine, the allocator's own)"
        label = f"{Path(python[0]['filename']).name}:{python[0]['line']} {python[0]['name']}"
        return label if ours is None else f"{Path(ours['filename']).name}:{ours['line']} {ours['name']} <- {label}"

    groups: dict[str, list] = {}
    for event in live.values():
        group = groups.setdefault(where(event.get("frames") or []), [0, 0])
        group[0] += event["size"]
        group[1] += 1
    lines = [f"memory at the step's peak: {(before + top) / GIB:.2f} GiB allocated ({before / GIB:.2f} before the "
             f"step, {top / GIB:.2f} allocated in it and alive; event {at} of {len(trace)})"]
    for label, (size, count) in sorted(groups.items(), key=lambda item: -item[1][0])[:rows]:
        lines.append(f"{size / GIB:9.3f} GiB {count:6d}x  {label[:150]}")
    return "\n".join(lines)


# GPU kernels by what they do, matched on lower-cased kernel names (first match wins).
KERNEL_KINDS = (("attention", ("flash", "fmha", "cudnn", "attention")),
                ("matmul", ("gemm", "nvjet", "sm90_", "cutlass", "xmma", "cublas", "splitk")),
                ("optimizer", ("multi_tensor", "foreach", "adam")),
                ("triton (compiled or LM head)", ("triton",)),
                ("nccl", ("nccl",)),
                ("copy / cast / fill", ("copy", "cast", "fill", "memcpy", "memset", "unrolled_elementwise")),
                ("other elementwise / reduce", ("elementwise", "reduce", "vectorized")))


def kernel_shares(averages) -> str:
    """A table of GPU time per ``KERNEL_KINDS`` entry over the profiled step's kernels."""
    from torch.autograd import DeviceType

    totals: dict[str, float] = {}
    for event in averages:
        if event.device_type != DeviceType.CUDA or "#" in event.key:  # "#": annotated ranges, not kernels
            continue
        name = event.key.lower()
        kind = next((k for k, needles in KERNEL_KINDS if any(n in name for n in needles)), "other")
        time_us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        totals[kind] = totals.get(kind, 0.0) + time_us
    whole = sum(totals.values()) or 1.0
    lines = [f"{'GPU time by kernel kind':<32}{'ms':>9}{'share':>8}"]
    lines += [f"{kind:<32}{us / 1000:>9.1f}{100 * us / whole:>7.1f}%"
              for kind, us in sorted(totals.items(), key=lambda item: -item[1])]
    lines.append(f"{'total':<32}{whole / 1000:>9.1f}")
    return "\n".join(lines)


def spawn(args, knob: str, seq_lens: list[int], kind: str, extra: list[str] = ()) -> None:
    command = [sys.executable, __file__, "worker", *(["--tiny"] if args.tiny else []), "--knob", knob, "--kind", kind,
               "--out", str(args.out),
               "--model-dir", str(args.model_dir), "--warmup", str(args.warmup), "--steps", str(args.steps),
               "--samples-per-rank", str(args.samples_per_rank), "--length", args.length,
               "--seq-lens", *map(str, seq_lens), *(["--attn", args.attn] if args.attn else []), *extra]
    log_path = args.out / f"{kind}-{knob}{'-' + args.attn if args.attn else ''}.log"
    with open(log_path, "w") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    print(f"{kind} {knob}: exit {code} ({log_path})", flush=True)
    if code:
        print(log_path.read_text()[-3000:], flush=True)


def table(out: Path) -> None:
    results = out / "results.jsonl"
    rows = [json.loads(line) for line in results.read_text().splitlines() if line.strip()] if results.exists() else []
    hf = {}
    if (out / "hf.json").exists():
        data = json.loads((out / "hf.json").read_text())
        for r in data.get("results", data if isinstance(data, list) else []):
            hf[r.get("seq_len")] = r
    print(f"{'run':<34}{'seq':>7}{'tok/s':>10}{'MFU':>8}{'peak GiB':>10}{'% dev':>7}{'plan GiB':>10}"
          f"{'MHz (capped)':>14}")
    for seq in sorted({r["seq_len"] for r in rows} | set(hf)):
        h = hf.get(seq)
        if h:
            tps = h.get("tokens_per_s")
            label = "hf baseline" + (" (grad ckpt)" if h.get("grad_checkpointing") else "")
            if h.get("status") != "ok" or tps is None:
                print(f"{label:<34}{seq:>7}{'OOM':>10}")
            else:
                print(f"{label:<34}{seq:>7}{tps:>10,.0f}{100 * (h.get('mfu') or 0):>7.1f}%"
                      f"{h.get('peak_mem_gib', 0):>10.1f}{h.get('peak_mem_pct', 0):>6.0f}%")
        for r in rows:
            if r["seq_len"] != seq:
                continue
            label = f"{r['kind']}: {r['config']}" + (f" ×{r.get('devices', 1)}" if r.get("devices", 1) > 1 else "")
            plan = f"{r['predicted_peak_gib']:>10.1f}" if "predicted_peak_gib" in r else f"{'':>10}"
            if "gpu_clock_mhz_mean" in r:  # the GPU's mean SM clock over the measured steps, and how often power-capped
                plan += f"{r['gpu_clock_mhz_mean']:>8,.0f} ({100 * r['gpu_power_capped_share']:.0f}%)"
            if r.get("oom"):
                print(f"{label:<34}{seq:>7}{'OOM':>10}{'':>25}{plan}")
            else:
                print(f"{label:<34}{seq:>7}{r['tokens_per_s']:>10,.0f}{100 * r['mfu']:>7.1f}%"
                      f"{r['peak_memory_gib']:>10.1f}{r['peak_memory_pct']:>6.0f}%{plan}")


SWITCHES = {
    "overlap": ("prime_plugin_fp8.linear.OVERLAP, the FP8 backward's input gradient on a second stream beside the "
                "bf16 weight gradient", ("prime_plugin_fp8.linear", "OVERLAP")),
    "transposed_cache": ("prime_plugin_fp8.weight_cache.TRANSPOSED, W.T's blocks kept through a step's passes",
                         ("prime_plugin_fp8.weight_cache", "TRANSPOSED")),
    "grouped_norms": ("prime_plugin_fsdp.norms.GROUPED, the gradient norm's squares launched a group of gradients "
                      "at a time", ("prime_plugin_fsdp.norms", "GROUPED")),
}


def set_switches(flags: list[str]) -> None:
    """``--set FLAG=on|off``: plugins' module switches, set before the model is built."""
    import importlib

    for item in flags:
        flag, value = item.split("=")
        module, name = SWITCHES[flag][1]
        setattr(importlib.import_module(module), name, value == "on")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("model", "knobs", "longest", "scaling", "worker", "table", "profile"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model-dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "qwen3-1.7b-random")
    parser.add_argument("--knobs", nargs="+", default=list(KNOBS))
    parser.add_argument("--knob", default="default")
    parser.add_argument("--attn", help="trainer.model.attn for every knob (e.g. flash_attention_4); default: each "
                                       "knob's")
    parser.add_argument("--kind", default="knobs")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--samples-per-rank", type=int, default=1)
    parser.add_argument("--length", choices=("fixed", "variable"), default="fixed",
                        help="variable: each sample 8 to seq_len tokens, packed into rows (several samples a row); "
                             "profile: those rows, trained once, then again timed and profiled")
    parser.add_argument("--stop-at-oom", action="store_true")
    parser.add_argument("--trace", action="store_true", help="profile: also write a gzipped Chrome trace of the step")
    parser.add_argument("--memory", action="store_true",
                        help="profile: instead of timing, what is allocated at the step's peak, by where")
    parser.add_argument("--tiny", action="store_true", help="a small model: smoke test on a CPU")
    parser.add_argument("--set", action="append", default=[], metavar="FLAG=on|off", choices=[
                            f"{flag}={value}" for flag in SWITCHES for value in ("on", "off")],
                        help="set one of the plugins' timing switches (repeatable): "
                             + "; ".join(f"{flag}: {where}" for flag, (where, _) in SWITCHES.items()))
    parser.add_argument("--gc", choices=("on", "off"), default="on",
                        help="profile: off freezes what Python's garbage collector holds after the first pass and "
                             "disables it for the timed and profiled ones (as torchtitan's gc_freq and Megatron's "
                             "--manual-gc keep it out of the steps)")
    args = parser.parse_args()
    set_switches(args.set)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        QWEN3_1_7B.update(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=32, intermediate_size=128, vocab_size=512)
        if args.mode != "worker":  # workers get the final folder
            args.model_dir = args.model_dir.with_name(args.model_dir.name + "-tiny")
    if args.mode == "table":
        table(args.out)
        return 0
    if args.mode == "worker":
        return worker(args)
    if args.mode == "profile":
        make_model(args.model_dir)
        return profile(args)
    if args.mode == "scaling":  # already under torchrun: this process is one rank
        # --knob picks the configuration (default: "default", what results/ recorded before)
        args.kind, args.seq_lens = f"scaling×{os.environ.get('WORLD_SIZE', 1)}", [args.seq_len]
        return worker(args)
    make_model(args.model_dir)
    if args.mode == "model":
        return 0
    if args.mode == "knobs":
        for knob in args.knobs:
            spawn(args, knob, args.seq_lens, args.kind)
    else:
        spawn(args, "all", args.seq_lens, "longest", ["--stop-at-oom"])
    table(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
