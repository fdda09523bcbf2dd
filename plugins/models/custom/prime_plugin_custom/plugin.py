"""Hooks of prime-plugin-custom: the ``custom`` model implementation (native Qwen3, Llama,
Qwen3-MoE and Qwen2-MoE, built for context and expert parallelism) and its ``grouped_mm``
kernels.

``trainer.model.impl = "auto"`` picks ``custom`` (priority 10) for a checkpoint whose
architecture and features it reproduces exactly, and ``hf`` otherwise. Importing this module
stays cheap: no torch until a model is built or a kernel runs.
"""

from __future__ import annotations

from prime_core import hookimpl
from prime_core.specs import Kernel, ModelImpl

PRIME_PLUGIN_API = 1


@hookimpl
def prime_model_impls():
    return [ModelImpl(
        name="custom", build="prime_plugin_custom.build:build", supports="prime_plugin_custom.families:supports",
        state_dict_adapter="prime_plugin_custom.adapter:ADAPTER", priority=10,
        memory="prime_plugin_custom.build:memory",
        description="native Qwen3 / Llama / Qwen3-MoE / Qwen2-MoE, packing-aware, with EP/CP hooks",
    )]


@hookimpl
def prime_kernels():
    return [
        Kernel(op="grouped_mm", name="torch", impl="prime_plugin_custom.moe:grouped_mm_torch",
               available="prime_plugin_custom.moe:torch_grouped_mm_unavailable",
               reference="loop", description="torch._grouped_mm (CUDA, bfloat16, sm90+) for MoE experts"),
        Kernel(op="grouped_mm", name="loop", impl="prime_plugin_custom.moe:grouped_mm_loop",
               description="one matmul per expert (reference, any device and dtype)"),
    ]
