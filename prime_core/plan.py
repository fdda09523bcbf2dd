"""``prime plan CONFIG``: the predicted peak memory of each trainer GPU, by term, and whether it
fits the GPUs the launcher places the trainer on, and whether what it keeps in host memory
(offloaded activations and optimizer state) fits this machine; ``prime run`` prints the same
verdicts as warnings before it launches a run that will not fit.

The prediction (``predict``) builds the model on the meta device and walks the trainer's build
order with the enabled strategies' ``memory`` hooks (``prime_core.memory``); nothing is
loaded or allocated, and no CUDA context is created (GPU sizes come from ``nvidia-smi``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any

from prime_core.memory import GIB, Prediction


def trainer_section(config, root: str):
    """The trainer's config (``trainer`` of an RL config, the config itself otherwise)."""
    return config.trainer if root == "rl" else config


def step_samples(config, root: str) -> int | None:
    """Samples one optimizer step trains on (``None`` when the config does not say)."""
    trainer = trainer_section(config, root)
    fake = getattr(getattr(trainer, "data", None), "fake", None)
    if fake is not None:
        return fake.batch_size
    if root == "rl":
        return config.orchestrator.batch_size
    return getattr(getattr(trainer, "data", None), "batch_size", None)  # SFT: data.batch_size


def predict(config, root: str, manager=None, *, processes: int | None = None, rows: int | None = None,
            seq_len: int | None = None) -> Prediction:
    """The predicted memory of one trainer process of ``config``."""
    from prime_core.memory import evaluate

    return evaluate(estimate(config, root, manager, processes=processes, rows=rows, seq_len=seq_len))


def estimate(config, root: str, manager=None, *, processes: int | None = None, rows: int | None = None,
             seq_len: int | None = None):
    """The ``prime_core.memory.Estimate`` of one trainer process of ``config``, every enabled
    strategy's ``memory`` hook applied (``predict`` evaluates it)."""
    import torch

    from prime_core.config.shared import model_section
    from prime_core.distributed import World
    from prime_core.hub import loading
    from prime_core.launch.config import trainer_processes
    from prime_core.memory import core_terms, generic_profiles, rows_per_rank, start
    from prime_core.plugins import get_plugin_manager
    from prime_core.trainer.build import DATA_PARALLEL, decide_defaults, enabled_strategies, parallel_dims
    from prime_core.trainer.model import resolve_impl
    from prime_core.trainer.step import rows_per_pass

    manager = manager or get_plugin_manager()
    model_config, _ = model_section(config, root)
    trainer = trainer_section(config, root)
    if processes is None:
        deployment = getattr(config, "deployment", None)
        processes = trainer_processes(deployment)[0] if deployment is not None else 1
    world = World(size=processes, device=torch.device("cuda"))  # planned for GPUs
    impl = resolve_impl(model_config, manager)
    # The keys a GPU run decides when it starts, decided alike (prime_core.trainer.defaults).
    model_config, choices = decide_defaults(model_config, manager, world, impl.name,
                                            "sft" if root == "sft" else "trainer", planning=True)
    strategies = enabled_strategies(model_config, manager, world, here=False)
    dims = parallel_dims(model_config, strategies, world)
    data_parallel = any(spec.slot == DATA_PARALLEL for spec in strategies)
    # The structure only, with the default kernels: a GPU kernel may not be importable here.
    meta_config = model_config.model_copy(update={"dtype": model_config.dtype, "attn": "sdpa", "kernels": {}})
    with loading(model_config.name, "model.name"):
        model = impl.build(meta_config, device="meta")
    profiles = impl.memory(model, model_config) if impl.memory is not None else generic_profiles(model, model_config)
    samples = step_samples(config, root)
    if rows is None:
        rows = rows_per_rank(samples, processes // dims.rows_split) if samples else 2
    longest = seq_len or trainer.seq_len
    stacked = 1 if any(spec.slot == "lm_head" for spec in strategies) else \
        rows_per_pass(model, longest, model_config.pass_tokens, dims.rows_split)
    est = start(model, model_config, processes=processes, tokens=longest * stacked, rows=-(-rows // stacked),
                data_parallel=data_parallel, blocks=profiles, degrees=dims.degrees)
    if stacked > 1:
        est.notes.append(f"{stacked} rows of {longest:,} tokens go through each forward pass, stacked "
                         f"(trainer.model.pass_tokens = {model_config.pass_tokens:,})")
    est.notes.extend(f"decided at start: {choice.shown()}" for choice in choices)
    if impl.memory is None:
        est.notes.append(f"model implementation '{impl.name}' has no memory profile: its blocks are counted as "
                         "transformers decoder blocks")
    if samples is None:
        est.notes.append("the config does not say how many samples a step has: counted as more than one row per "
                         "rank (the gradients of earlier rows stay on the GPU)")
    core_terms(est, trainer)
    ops = sorted(set(getattr(model_config, "kernels", None) or {}) - {"lm_head"})
    if ops:
        est.notes.append(f"kernels for {', '.join(ops)} (trainer.model.kernels) are counted as the eager ops they "
                         "replace")
    for spec in strategies:
        if spec.memory is not None:
            spec.memory(est, model_config)
        else:
            est.notes.append(f"strategy '{spec.name}' has no memory model: what it adds is not counted")
    return est


# ------------------------------------------------------------------ the GPUs


def gpu_memory(indices: list[str] | None = None) -> dict[str, float]:
    """Total memory in bytes of the GPUs the driver lists (``nvidia-smi``; no CUDA context),
    by index; only ``indices`` when given. Empty without a driver."""
    if shutil.which("nvidia-smi") is None:
        return {}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found = {}
    for line in out.stdout.splitlines() if out.returncode == 0 else []:
        index, _, mib = line.partition(",")
        if mib.strip().isdigit():
            found[index.strip()] = float(mib.strip()) * (1 << 20)
    return {i: size for i, size in found.items() if indices is None or i in indices}


def trainer_gpus(plan) -> list[str] | None:
    """The GPU indices a launch plan gives the trainer (``None`` when it places none here)."""
    for row in getattr(plan, "placement", None) or []:
        if row.get("role") in ("trainer", "sft") and row.get("gpus") not in (None, "", "-", "cpu"):
            return [g.strip() for g in str(row["gpus"]).split(",") if g.strip()]
    return None


def verdict(prediction: Prediction, capacity: float | None) -> tuple[bool | None, str]:
    """``(fits, a sentence)``; ``fits`` is ``None`` when no device size is known."""
    needs = prediction.needs()
    if capacity is None:
        return None, (f"predicted peak {prediction.peak / GIB:.1f} GiB per trainer GPU ({needs / GIB:.1f} GiB with "
                      "the allocator's headroom); no GPU here to compare with (--gpu-memory GIB)")
    fits = needs <= capacity
    return fits, (f"predicted peak {prediction.peak / GIB:.1f} GiB per trainer GPU, {needs / GIB:.1f} GiB with the "
                  f"allocator's headroom, on {capacity / GIB:.1f} GiB GPUs: "
                  + ("fits" if fits else "does NOT fit"))


HOST_SHARE = 0.85
"""The share of this machine's memory that the trainer processes' host terms may take; the rest
is the processes themselves (libraries, CUDA's context, compiled code: a few GiB each) and
whatever else the machine runs."""


def host_memory() -> float | None:
    """This machine's physical memory in bytes (``None`` where the system does not say)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def host_verdict(prediction: Prediction, processes: int, capacity: float | None) -> tuple[bool | None, str | None]:
    """``(fits, a sentence)`` for what ``processes`` trainer processes on this machine keep in host
    memory; ``(None, None)`` when they keep nothing there."""
    needs = sum(prediction.cpu.values()) * processes
    if not needs:
        return None, None
    said = f"host memory: {needs / GIB:.1f} GiB for {processes} trainer process(es)"
    if capacity is None:
        return None, f"{said}; this machine's size is unknown (--host-memory GIB)"
    fits = needs <= HOST_SHARE * capacity
    return fits, (f"{said} on a machine of {capacity / GIB:.1f} GiB: " + (
        "fits" if fits else
        f"does NOT fit in {HOST_SHARE:.0%} of it (the rest is the processes themselves); "
        "[trainer.model.ac_offloading] blocks = N offloads only the first N blocks' activations, and "
        "without trainer.model.optim_cpu_offload the optimizer state stays on the GPU"))


# ------------------------------------------------------------------ output


def table(prediction: Prediction, capacity: float | None = None, title: str = "predicted memory per trainer GPU"):
    from rich.table import Table

    grid = Table(title=title, title_justify="left")
    grid.add_column("term")
    grid.add_column("GiB", justify="right")
    for name, size in prediction.terms.items():
        if size:
            grid.add_row(name, f"{size / GIB:.2f}")
    for name, size in prediction.phases.items():
        marker = "  <- peak" if name == prediction.phase else ""
        grid.add_row(f"[bold]peak at {name}[/bold]{marker}", f"{size / GIB:.2f}")
    for name, size in prediction.cpu.items():
        grid.add_row(f"host memory: {name}", f"{size / GIB:.2f}")
    if capacity is not None:
        grid.add_row("GPU", f"{capacity / GIB:.1f}")
    return grid


def describe(prediction: Prediction) -> str:
    return (f"{prediction.processes} trainer process(es), rows of {prediction.tokens:,} tokens per forward pass, "
            f"{prediction.rows} row(s) per step and rank, LM head: {prediction.lm_head}")


def show(config, root: str, *, gpu_memory_gib: float | None = None, host_memory_gib: float | None = None, plan=None,
         console=None) -> Prediction:
    """Predict, print the table and the verdicts (``prime plan``)."""
    from rich.console import Console

    console = console or Console(highlight=False)
    prediction = predict(config, root)
    capacity = _capacity(plan, gpu_memory_gib)
    console.print(table(prediction, capacity))
    console.print(describe(prediction), markup=False)
    for note in prediction.notes:
        console.print(f"note: {note}", markup=False)
    fits, sentence = verdict(prediction, capacity)
    console.print(sentence, markup=False, soft_wrap=True)
    host = host_memory_gib * GIB if host_memory_gib is not None else host_memory()
    _, sentence = host_verdict(prediction, _local_processes(plan, prediction), host)
    if sentence:
        console.print(sentence, markup=False, soft_wrap=True)
    return prediction


def _local_processes(plan, prediction: Prediction) -> int:
    """Trainer processes on this machine: one per GPU the launch plan places here, else all."""
    gpus = trainer_gpus(plan) if plan is not None else None
    return len(gpus) if gpus else prediction.processes


def _capacity(plan, gpu_memory_gib: float | None) -> float | None:
    if gpu_memory_gib is not None:
        return gpu_memory_gib * GIB
    gpus = trainer_gpus(plan) if plan is not None else None
    sizes = gpu_memory(gpus) if gpus else {}
    return min(sizes.values()) if sizes else None


def warn_before_launch(config, root: str, plan, warn) -> Any:
    """``prime run``: a warning when the trainer's predicted peak exceeds its GPUs, or what its
    processes keep in host memory exceeds this machine (nothing when both fit, when no GPU is
    placed here, or when the prediction cannot be made)."""
    gpus = trainer_gpus(plan)
    sizes = gpu_memory(gpus) if gpus else {}
    if not sizes:
        return None
    try:
        prediction = predict(config, root)
    except Exception as exc:  # a prediction must never stop a launch
        warn(f"could not predict the trainer's memory ({type(exc).__name__}: {exc}); `prime plan` shows why")
        return None
    fits, sentence = verdict(prediction, min(sizes.values()))
    if not fits:
        warn(f"{sentence}; `prime plan` shows the terms (docs/trainer.md lists the knobs that reduce them)")
    fits, sentence = host_verdict(prediction, len(gpus), host_memory())
    if fits is False:
        warn(f"{sentence}; `prime plan` shows the terms")
    return prediction
