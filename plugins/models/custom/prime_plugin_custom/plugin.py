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
from prime_plugin_custom.adapter import ADAPTER

PRIME_PLUGIN_API = 1


def _build(model_config, **kwargs):
    from prime_plugin_custom.build import build

    return build(model_config, **kwargs)


def _supports(hf_config) -> bool:
    from prime_plugin_custom.families import supports

    return supports(hf_config)


def _grouped_mm_torch(x, w, counts):
    from prime_plugin_custom.moe import grouped_mm_torch

    return grouped_mm_torch(x, w, counts)


def _grouped_mm_loop(x, w, counts):
    from prime_plugin_custom.moe import grouped_mm_loop

    return grouped_mm_loop(x, w, counts)


def _torch_grouped_mm_unavailable() -> str | None:
    from prime_plugin_custom.moe import torch_grouped_mm_unavailable

    return torch_grouped_mm_unavailable()


@hookimpl
def prime_model_impls():
    return [ModelImpl(
        name="custom", build=_build, supports=_supports, state_dict_adapter=ADAPTER, priority=10,
        description="native Qwen3 / Llama / Qwen3-MoE / Qwen2-MoE, packing-aware, with EP/CP hooks",
    )]


@hookimpl
def prime_kernels():
    return [
        Kernel(op="grouped_mm", name="torch", impl=_grouped_mm_torch, available=_torch_grouped_mm_unavailable,
               reference="loop", description="torch._grouped_mm (CUDA, bfloat16, sm90+) for MoE experts"),
        Kernel(op="grouped_mm", name="loop", impl=_grouped_mm_loop,
               description="one matmul per expert (reference, any device and dtype)"),
    ]
