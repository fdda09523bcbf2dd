"""Hooks of prime-plugin-fp8: the ``fp8_linear`` kernels, block-scaled FP8 training GEMMs for
the transformer blocks' linear layers.

Registered as ``fp8_linear:auto``, ``fp8_linear:deep_gemm``, ``fp8_linear:torch`` and
``fp8_linear:emulated``. Each ``impl(model, *, fp8_wgrad=True) -> int`` converts ``model``'s
block projections in place to FP8 linears running that backend and returns how many it
converted (``convert.convert``). ``auto`` picks per device at run time (DeepGEMM, else
``torch._scaled_mm``; the emulated reference off CUDA). ``trainer.model.quantization = "fp8"``
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


def _convert(model, *, backend: str, fp8_wgrad: bool = True) -> int:
    from prime_plugin_fp8.convert import convert

    return convert(model, backend, fp8_wgrad=fp8_wgrad)


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


def memory(est, config) -> None:
    """``prime plan``: each FP8 linear whose weight trains saves its input as ``x.T`` in FP8
    (not ``x``), so a block's projection inputs are counted again: q, k, v and o each keep a
    copy of their input (where q, k and v shared one, and ``o_proj``'s input is attention's
    output, which attention keeps anyway), gate and up one each, down its input (the SwiGLU
    product, which nothing else keeps; compiled, it is no longer saved either). MoE experts
    stay high precision (their shared expert, small, is not recounted). Frozen weights (LoRA's
    base) save no input: nothing changes. Only one linear's FP8 copies of its weight and of
    the activations it quantises are alive at a time: one byte per element of the largest
    block's weight and of the row's widest activation."""
    largest = max(est.block_numel(), default=0)
    est.add_buffer("fp8: quantised copies of one block", largest + est.tokens * 4 * est.hidden, ("backward",))
    if getattr(config, "lora", None):
        return
    model_config = est.model.config
    hidden = est.hidden
    heads = model_config.num_attention_heads
    q = heads * (getattr(model_config, "head_dim", None) or hidden // heads)
    inter = getattr(model_config, "intermediate_size", 0)

    def rule(block) -> None:
        parts = block.parts
        if "attn_proj" in parts:
            parts["attn_proj"] = FP8_BYTES * (3 * hidden + q)
        if "mlp_proj" in parts and "router" not in parts:
            parts["mlp_proj"] = FP8_BYTES * (2 * hidden + inter)
            if est.compiled:  # Inductor kept the SwiGLU product for down_proj's backward
                parts["mlp"] -= est.compute_bytes * inter
        block.gpu = sum(parts.values())

    est.rules.append(rule)


@hookimpl
def prime_kernels():
    return [
        Kernel(op="fp8_linear", name=name, impl=functools.partial(_convert, backend=name),
               available=functools.partial(_unavailable, name), description=description,
               reference="" if name == "emulated" else "emulated")
        for name, description in _DESCRIPTIONS.items()
    ]
