"""Benchmark mode (``--bench``): a few warm-up and measured steps, then a table of step time,
tokens/s, MFU and peak memory.

MFU (model FLOPs utilisation) = useful FLOPs per second / the device's peak. Useful FLOPs of a
training step over samples of lengths ``s_i`` (fwd + bwd, causal attention):

    6 · N · Σ s_i  +  6 · n_layers · (n_heads · head_dim) · Σ s_i²

``N`` counts every parameter that takes part in matmuls: all parameters except the input
embedding, with the LM head counted once even when tied to it. The attention term counts
``Q·Kᵀ`` and ``A·V`` (2 · s² · d each forward, halved by the causal mask, ×3 for fwd+bwd).
Recomputation (activation checkpointing) is not useful work and is not counted. The peak is
the dense bf16/fp16 tensor-core figure of the device from a table, or measured with a large
matmul where the device is not in it (CPUs).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from pathlib import Path

from pydantic import Field

from prime_core import gpu_clocks
from prime_core.config.base import Section
from prime_core.trainer.step import StepClock


class BenchConfig(Section):
    """``--bench``: run ``warmup_steps`` + ``steps`` steps on fake data and print a throughput table."""

    warmup_steps: int = Field(default=2, ge=0)
    steps: int = Field(default=3, ge=1)
    output_json: Path | None = None
    """Also save the results here."""

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.steps


# Dense peak (FLOP/s) with bf16/fp16 tensor cores, by a substring of the device name.
PEAK_FLOPS = {
    "H200": 989e12, "H100": 989e12, "H800": 989e12, "H20": 148e12, "GH200": 989e12,
    "B200": 2250e12, "B100": 1750e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12,
    "A10G": 125e12, "L4": 121e12, "RTX 4090": 165e12,
}


def device_description(device) -> str:
    import platform

    import torch

    if getattr(device, "type", device) == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    return f"CPU ({cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def peak_flops(device, dtype: str) -> tuple[float, str]:
    """``(FLOP/s, source)`` for one device of this kind."""
    name = device_description(device)
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_FLOPS[key], f"table ({key}, dense bf16)"
    return measured_peak(device, dtype), "measured (matmul)"


def measured_peak(device, dtype: str, size: int = 1024, seconds: float = 0.5) -> float:
    import torch

    dt = getattr(torch, dtype)
    a = torch.randn(size, size, device=device, dtype=dt)
    b = torch.randn(size, size, device=device, dtype=dt)
    a @ b
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    if getattr(device, "type", device) == "cuda":
        torch.cuda.synchronize(device)
    return 2 * size**3 * count / (time.perf_counter() - start)


def matmul_params(model, hf_config) -> int:
    """``N`` above, from the full (unsharded) parameter shapes. In a mixture of experts only
    the ``k`` of ``E`` experts a token is routed to count (active parameters)."""
    total = experts = 0
    for name, param in model.named_parameters():
        total += param.numel()  # DTensor.numel() is the global size
        if ".experts." in name:
            experts += param.numel()
    num_experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
    if experts and num_experts:
        total -= experts - experts * getattr(hf_config, "num_experts_per_tok", num_experts) // num_experts
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    embed_numel = embed.weight.numel() if embed is not None else 0
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    return total if tied else total - embed_numel


def attention_dims(hf_config) -> tuple[int, int]:
    layers = getattr(hf_config, "num_hidden_layers", 0)
    heads = getattr(hf_config, "num_attention_heads", 0)
    head_dim = getattr(hf_config, "head_dim", None) or (getattr(hf_config, "hidden_size", 0) // max(1, heads))
    return layers, heads * head_dim


def sample_lengths(position_ids: list[int]) -> list[int]:
    """Lengths of the samples packed in one row (each starts at position 0)."""
    lengths: list[int] = []
    for pos in position_ids:
        if pos == 0 or not lengths:
            lengths.append(0)
        lengths[-1] += 1
    return lengths


def step_flops(rows: list[dict], n_params: int, hf_config) -> float:
    layers, width = attention_dims(hf_config)
    tokens = squares = 0
    for row in rows:
        if row.get("padding"):
            continue
        for length in sample_lengths(row["position_ids"]):
            tokens += length
            squares += length * length
    return 6.0 * n_params * tokens + 6.0 * layers * width * squares


def reset_peak_memory(device) -> None:
    import torch

    if getattr(device, "type", device) == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device) -> tuple[float, float]:
    """``(peak bytes, device capacity bytes)``: allocator peak on GPUs, process peak RSS on CPUs."""
    import torch

    if getattr(device, "type", device) == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return float(torch.cuda.max_memory_allocated(device)), float(total)
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return rss, float(total)


class BenchMeter:
    """Collects the measured steps of one rank and reports for the whole job on rank 0."""

    @classmethod
    def for_run(cls, config, training, *, role: str, data: str, pipelined: bool = False) -> BenchMeter:
        """The meter of ``prime trainer|sft --bench`` (``config``: the role's config)."""
        policy = training.policy
        label = {"role": role, "model": str(config.model.name), "seq_len": config.seq_len,
                 "config": ", ".join(policy.applied) or "plain", "data": data}
        return cls(config.bench, world=training.world, model=policy.model, hf_config=policy.hf_config,
                   dtype=config.model.dtype, label=label, pipelined=pipelined)

    def __init__(self, config: BenchConfig, *, world, model, hf_config, dtype: str, label: dict,
                 pipelined: bool = False) -> None:
        """``pipelined``: each step is queued before the one before is read, as ``prime sft``
        does; otherwise each is read before the next starts, as ``prime trainer`` does (it
        publishes every step's weights)."""
        self.config = config
        self.pipelined = pipelined
        self.world = world
        self.n_params = matmul_params(model, hf_config)
        self.hf_config = hf_config
        self.dtype = dtype
        self.label = {**label, "loop": "pipelined" if pipelined else "step by step"}
        self.steps: list[dict] = []  # this rank's: reduced over the ranks in ``result``
        self.clock = StepClock(world.device)
        self.gpu_clocks = gpu_clocks.ClockSampler.for_device(world.device)  # sampled over the measured steps

    def run_fake_steps(self, training, fake, seq_len: int, rng, *, loss_fn, max_norm, loss_kwargs=None,
                       on_step=None) -> dict:
        """Train ``warmup + steps`` steps on fake batches of ``seq_len`` (``trainer.fake``),
        measuring each; ``on_step(step, sums)`` after each. Returns the last batch."""
        from prime_core.trainer.fake import fake_batch
        from prime_core.trainer.step import queue_train_step

        # Made first, as a data loader would have them ready: the step is what is measured.
        batches = [fake_batch(fake, seq_len, training.policy.hf_config.vocab_size, rng)
                   for _ in range(self.config.total_steps)]
        pending = None
        for step, batch in enumerate(batches, 1):
            started = self.start_step(step)
            read = queue_train_step(training, batch["micro_batches"], max_norm=max_norm, loss_fn=loss_fn,
                                    loss_kwargs=loss_kwargs)
            queued = (step, started, self.clock.mark(), read)
            if pending is not None:
                self._read(*pending, on_step=on_step)
            pending = queued
            if not self.pipelined:
                self._read(*pending, on_step=on_step)
                pending = None
        if pending is not None:
            self._read(*pending, on_step=on_step)
        return batches[-1]

    def _read(self, step: int, started, ended, read, *, on_step) -> None:
        sums = read()
        self.end_step(step, started, ended, sums["rows"])
        if on_step is not None:
            on_step(step, sums)

    def start_step(self, step: int):
        """Called before ``step`` is queued (step by step, once the device and every rank are
        done with the step before); returns the step's start mark (``StepClock``)."""
        from prime_core import distributed

        if step == self.config.warmup_steps + 1:
            reset_peak_memory(self.world.device)
            self.gpu_clocks.start()
        if not self.pipelined:
            synchronize(self.world.device)
            distributed.barrier(self.world)
        return self.clock.mark()

    def end_step(self, step: int, started, ended, rows: list[dict]) -> None:
        """Called once ``step``, queued between marks ``started`` and ``ended``, is read."""
        elapsed = self.clock.step_time(started, ended)
        cp = self.world.rows_split  # the ranks of a CP group hold the same rows
        tokens = sum(len(r["input_ids"]) for r in rows if not r.get("padding")) / cp
        flops = step_flops(rows, self.n_params, self.hf_config) / cp
        if step > self.config.warmup_steps:
            self.steps.append({"step_time": elapsed, "tokens": tokens, "flops": flops})

    def result(self) -> dict:
        from prime_core import distributed

        peak_bytes, capacity = peak_memory(self.world.device)
        (peak_bytes,) = distributed.all_reduce([peak_bytes], self.world, "max")
        clocks = gpu_clocks.over_ranks(self.gpu_clocks.stop(), self.world)
        # Every rank's steps: tokens and FLOPs summed, the slowest rank's time.
        n = len(self.steps)
        summed = distributed.all_reduce([s["tokens"] for s in self.steps] + [s["flops"] for s in self.steps],
                                        self.world)
        slowest = distributed.all_reduce([s["step_time"] for s in self.steps], self.world, "max")
        steps = [{"tokens": summed[i], "flops": summed[n + i], "step_time": slowest[i]} for i in range(n)]
        device_peak, source = peak_flops(self.world.device, self.dtype)
        times = [s["step_time"] for s in steps]
        tokens_per_s = [s["tokens"] / s["step_time"] for s in steps]
        mfu = [s["flops"] / s["step_time"] / (device_peak * self.world.size) for s in steps]
        return {
            **self.label,
            "device": device_description(self.world.device), "devices": self.world.size,
            "steps": len(steps), "warmup_steps": self.config.warmup_steps,
            "step_time_s": statistics.mean(times), "step_time_std_s": statistics.pstdev(times),
            "step_time_median_s": statistics.median(times),
            "step_times_s": [round(t, 6) for t in times],  # an outlier (a recompilation, say) shows here
            "tokens_per_step": statistics.mean(s["tokens"] for s in steps),
            "tokens_per_s": statistics.mean(tokens_per_s),
            "tokens_per_s_per_device": statistics.mean(tokens_per_s) / self.world.size,
            "mfu": statistics.mean(mfu), "peak_flops": device_peak, "peak_flops_source": source,
            "matmul_params": self.n_params,
            "peak_memory_gib": peak_bytes / 2**30, "peak_memory_pct": 100.0 * peak_bytes / capacity,
            "device_memory_gib": capacity / 2**30,
            **(clocks or {}),
        }

    def report(self) -> dict | None:
        """Print the table (rank 0) and save ``output_json``; returns the result on rank 0."""
        result = self.result()
        if not self.world.main:
            return None
        print_table(result)
        if self.config.output_json:
            path = Path(self.config.output_json)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(result, indent=2) + "\n")
            print(f"bench: results saved to {path}", flush=True)
        return result


def synchronize(device) -> None:
    import torch

    if getattr(device, "type", device) == "cuda":
        torch.cuda.synchronize(device)


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    title = " · ".join(f"{k} {v}" for k, v in result.items() if k in ("role", "model", "seq_len", "config"))
    table = Table(title=f"benchmark: {title}", show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("device", f"{result['devices']} × {result['device']}"),
        ("measured steps (after warm-up)", f"{result['steps']} (after {result['warmup_steps']})"),
        ("step time", f"{result['step_time_s']:.3f} s ± {result['step_time_std_s']:.3f}"),
        ("tokens per step", f"{result['tokens_per_step']:,.0f}"),
        ("tokens/s", f"{result['tokens_per_s']:,.0f}"),
        ("tokens/s per device", f"{result['tokens_per_s_per_device']:,.0f}"),
        ("MFU", f"{100 * result['mfu']:.1f} %" if math.isfinite(result["mfu"]) else "n/a"),
        ("peak FLOP/s per device", f"{result['peak_flops'] / 1e12:,.1f} T ({result['peak_flops_source']})"),
        ("peak memory", f"{result['peak_memory_gib']:.2f} GiB ({result['peak_memory_pct']:.1f} % of "
                        f"{result['device_memory_gib']:.0f} GiB)"),
    ]
    if "gpu_clock_mhz_mean" in result:
        rows.append(("GPU clock (measured steps)", gpu_clocks.describe(result)))
    for name, value in rows:
        table.add_row(name, value)
    Console(highlight=False).print(table)
