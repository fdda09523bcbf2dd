"""``convert(model, backend)``: turn the transformer blocks' projections into ``FP8Linear``.

Converted: every ``nn.Linear`` inside the blocks (``prime_core.trainer.model.transformer_blocks``)
named ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj`` or ``down_proj``
(a MoE block's shared expert included), and the ``base`` / ``base_layer`` linear a LoRA wrapper
keeps under such a name (the adapters ``lora_A`` / ``lora_B`` stay as they are). Never
converted: anything outside the blocks (embeddings, ``lm_head``), the MoE router ``gate`` and
``shared_expert_gate``, norms, and the stacked MoE experts (their ``grouped_mm`` stays bf16:
an FP8 grouped GEMM is not implemented here).

The swap keeps the Parameter objects and the module names, so state-dict keys, optimizer
parameter groups and FSDP sharding are unaffected. It touches no tensor data and works on a
meta-device model. Run it after LoRA and before any wrapping strategy (EP, CP, activation
checkpointing, compile, FSDP): see the README.
"""

from __future__ import annotations

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WRAPPED = ("base", "base_layer")  # where prime's LoRA / PEFT keep the wrapped linear


def _target_name(name: str) -> str:
    parts = name.split(".")
    while len(parts) > 1 and parts[-1] in WRAPPED:
        parts.pop()
    return parts[-1]


def convertible(block, names=TARGETS):
    """``(name, linear)`` for each plain ``nn.Linear`` of ``block`` that ``convert`` swaps."""
    from torch import nn

    return [(name, module) for name, module in block.named_modules()
            if type(module) is nn.Linear and _target_name(name) in names]


def convert(model, backend: str = "auto", *, targets=TARGETS, fp8_wgrad: bool = True,
            cache_weight: bool = False) -> int:
    """Swap the target linears of ``model``'s transformer blocks for ``FP8Linear(backend)``
    in place; returns how many were swapped (0 when there were none, or all were already)."""
    from prime_core.trainer.model import transformer_blocks
    from prime_plugin_fp8.gemm import NAMES
    from prime_plugin_fp8.linear import FP8Linear

    if backend not in NAMES:
        raise ValueError(f"unknown FP8 backend {backend!r}: choose one of {', '.join(NAMES)}")
    converted = 0
    for block in transformer_blocks(model):
        for name, module in convertible(block, targets):
            parent_name, _, child = name.rpartition(".")
            parent = block.get_submodule(parent_name) if parent_name else block
            setattr(parent, child, FP8Linear(module, backend=backend, fp8_wgrad=fp8_wgrad, cache_weight=cache_weight))
            converted += 1
    return converted

