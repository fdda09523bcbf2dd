"""Hooks of prime-plugin-fp8: the ``fp8_linear`` kernels, block-scaled FP8 training GEMMs for
the transformer blocks' linear layers.

Registered as ``fp8_linear:auto``, ``fp8_linear:deep_gemm``, ``fp8_linear:torch`` and
``fp8_linear:emulated``. Each ``impl(model, *, fp8_wgrad=True, cache_weight=False) -> int``
converts ``model``'s block projections in place to FP8 linears running that backend and
returns how many it converted (``convert.convert``). ``auto`` picks per device at run time
(DeepGEMM, else ``torch._scaled_mm``; the emulated reference off CUDA). ``trainer.model.quantization = "fp8"``
turns on the ``fp8`` strategy (``quantization`` slot of the build order), which converts with
the kernel ``trainer.model.kernels.fp8_linear`` names (``auto`` by default). Importing this
module does not import torch.
"""

from __future__ import annotations

import functools

from prime_core import hookimpl
from prime_core.specs import ConfigSection, Kernel, ParallelStrategy

PRIME_PLUGIN_API = 1

_DESCRIPTIONS = {
    "auto": "block-scaled FP8 linears; per device: deep_gemm, else torch, else (off CUDA) emulated",
    "deep_gemm": "block-scaled FP8 linears on DeepGEMM's fp8_gemm_nt (SM90)",
    "torch": "block-scaled FP8 linears on torch scaled_mm (blockwise recipes on SM90, per-K-chunk elsewhere)",
    "emulated": "block-scaled FP8 linears emulated in float32 (any device; the numerical reference)",
}


def _convert(model, *, backend: str, fp8_wgrad: bool = True, cache_weight: bool = False) -> int:
    from prime_plugin_fp8.convert import convert

    return convert(model, backend, fp8_wgrad=fp8_wgrad, cache_weight=cache_weight)


def _unavailable(name: str) -> str | None:
    from prime_plugin_fp8.gemm import unavailable

    return unavailable(name)


@hookimpl
def prime_config_sections():
    return [ConfigSection(name="trainer.model", model="prime_plugin_fp8.config:FP8Keys", merge=True,
                          roots=("rl", "sft"))]


@hookimpl
def prime_parallel_strategies():
    return [ParallelStrategy(name="fp8", slot="quantization", apply="prime_plugin_fp8.strategy:apply",
                             enabled=lambda config, world: config.quantization == "fp8", reference=True,
                             memory=memory, description="the transformer blocks' linear layers in block-scaled FP8")]


FP8_BYTES = 1 + 4 / 128
"""Bytes a value of a quantised activation: one FP8 byte and a float32 scale per 128."""
FP8_WEIGHT_BYTES = 1 + 4 / 128**2
"""Bytes a value of a quantised weight: one FP8 byte and a float32 scale per 128 × 128 block."""


def memory(est, config) -> None:
    """``prime plan``: each FP8 linear whose weight trains saves its input as ``x.T`` in FP8,
    not ``x``, so a block's projection inputs are counted again: a copy per linear, or one per
    group its model runs together (``grouped_projections``, ``FP8Linear.forward_group``: whole
    128-row weight blocks), where the bf16 linears shared ``x`` (and ``o_proj``'s input is
    attention's output, which attention keeps anyway); down's input, the SwiGLU product, is
    no longer kept by anything (compiled, Inductor kept it). MoE experts stay high precision
    (their shared expert, small, is not recounted). Frozen weights (LoRA's base) save no
    input: nothing changes; nor does ``fp8_wgrad = false`` (the linear keeps ``x`` itself, as
    bf16 does). Only one linear's (or group's) transient copies are alive at a
    time: its weights concatenated in their own precision (a group) and quantised, and its
    activations' FP8 copies, bounded by the largest block's weight at compute precision plus a
    byte, and a byte for the row's widest activation. With ``fp8_weight_cache`` in one process,
    a step of several passes adds a byte a converted weight, and one of more than two passes
    two (``weight_cache``)."""
    from prime_core.trainer.model import transformer_blocks
    from prime_plugin_fp8 import weight_cache
    from prime_plugin_fp8.strategy import caches_weights

    largest = max(est.block_numel(), default=0)
    copies = largest * (1 + est.compute_bytes) + est.tokens * 4 * est.hidden
    est.add_buffer("fp8: quantised copies of one block", copies, ("backward",))
    if caches_weights(config, est.processes) and est.rows > 1:
        # Where a backward starts beside the gradients of the passes before it (from the second
        # pass on): W.T's blocks, stored by the first backward and kept into the last; and the
        # forward's, dropped as the last backward starts, so only where an earlier one is second.
        kinds = (est.rows > 2) + weight_cache.TRANSPOSED
        if kinds:
            est.add_buffer("fp8: weight blocks kept through the step's passes",
                           kinds * FP8_WEIGHT_BYTES * _converted(est.model), ("backward",))
    if getattr(config, "lora", None) or not config.fp8_wgrad:
        return
    saved = [(_fp8_inputs(block, ("q_proj", "k_proj", "v_proj", "o_proj")),
              _fp8_inputs(getattr(block, "mlp", None), ("gate_proj", "up_proj", "down_proj")))
             for block in transformer_blocks(est.model)]

    def rule(block) -> None:
        attention, mlp = saved[block.index]
        parts = block.parts
        if "attn_proj" in parts and attention:
            parts["attn_proj"] = FP8_BYTES * attention
        if "mlp_proj" in parts and "router" not in parts and mlp:
            parts["mlp_proj"] = FP8_BYTES * mlp
            if est.compiled:  # Inductor kept the SwiGLU product for down_proj's backward
                parts["mlp"] -= est.compute_bytes * est.model.config.intermediate_size
        block.gpu = sum(parts.values())

    est.rules.append(rule)


def _converted(model) -> int:
    """Elements of the weights ``convert`` turns into FP8 linears."""
    from prime_core.trainer.model import transformer_blocks
    from prime_plugin_fp8.convert import convertible

    return sum(linear.weight.numel() for block in transformer_blocks(model) for _, linear in convertible(block))


def _fp8_inputs(module, names) -> int:
    """Values a token the FP8 linears ``names`` (children of ``module``, or of the one
    submodule holding the first of them) save: their inputs, once per group run together."""
    from prime_plugin_fp8.linear import groupable

    if module is None:
        return 0
    if not hasattr(module, names[0]):
        module = next((m for m in module.modules() if hasattr(m, names[0])), None)
        if module is None:
            return 0
    linears = {name: getattr(module, name) for name in names if hasattr(module, name)}
    values, grouped = 0, set()
    for group in getattr(module, "grouped_projections", ()):
        members = [linears[name] for name in group if name in linears]
        if len(members) == len(group) > 1 and groupable([m.out_features for m in members]):
            values += members[0].in_features
            grouped.update(group)
    return values + sum(m.in_features for name, m in linears.items() if name not in grouped)


@hookimpl
def prime_kernels():
    return [
        Kernel(op="fp8_linear", name=name, impl=functools.partial(_convert, backend=name),
               available=functools.partial(_unavailable, name), description=description,
               reference="" if name == "emulated" else "emulated")
        for name, description in _DESCRIPTIONS.items()
    ]
