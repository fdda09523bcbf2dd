"""The lora strategy's terms of the predicted memory (``prime plan``; ``prime_core.memory``)."""

from __future__ import annotations


def memory(est, config) -> None:
    """The base weights stay frozen (no gradient, no optimizer state); every targeted linear
    gets ``rank × (in + out)`` trainable adapter weights in its block. (The activations the
    adapters add, ``rank`` per token and linear, are small and not counted.)"""
    from prime_core.memory import Param

    lora = config.lora
    for param in est.params.values():
        param.trainable = False
    block_of = {}
    from prime_core.trainer.model import transformer_blocks

    for index, block in enumerate(transformer_blocks(est.model)):
        for module in block.modules():
            block_of[id(module)] = index
    for name, module in est.model.named_modules():
        if name.rsplit(".", 1)[-1] in lora.target_modules and hasattr(module, "in_features"):
            est.params[f"{name}.lora"] = Param(lora.rank * (module.in_features + module.out_features),
                                               block=block_of.get(id(module)))
