"""Hooks of prime-plugin-lora: the ``lora`` strategy, first in the trainer's build order."""

from __future__ import annotations

from prime_core import hookimpl
from prime_core.specs import ParallelStrategy

PRIME_PLUGIN_API = 1


def _apply(model, **kwargs):
    from prime_plugin_lora.lora import apply

    return apply(model, **kwargs)


@hookimpl
def prime_parallel_strategies():
    return [ParallelStrategy(name="lora", apply=_apply,
                             description="LoRA adapters: only they are trained and published")]


@hookimpl
def prime_validate_config(config, root):
    trainer = getattr(config, "trainer", None) if root == "rl" else config
    lora = getattr(getattr(trainer, "model", None), "lora", None)
    key = "trainer.model.lora" if root == "rl" else "model.lora"
    if lora is not None and lora.modules_to_save:
        return [f"{key}.modules_to_save = {lora.modules_to_save}: not supported (vLLM cannot serve adapters "
                "with fully trained modules); leave it empty"]
    return None
