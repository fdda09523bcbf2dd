"""The ``fp8`` strategy (``quantization`` slot): convert the blocks' linear layers to FP8.

It runs after LoRA (whose base layers it converts) and before every strategy that wraps or
shards. Like LoRA it changes what the model computes, so parity references get it too.
"""

from __future__ import annotations


def caches_weights(config, processes: int) -> bool:
    """Whether the linears keep their weights' blocks across a step's passes (``weight_cache``):
    ``fp8_weight_cache`` in one process (with several, FSDP gathers the weights for every pass)."""
    return config.fp8_weight_cache and processes == 1


def apply(model, *, config, world=None, **_):
    from prime_core.errors import PluginError
    from prime_core.plugins import get_plugin_manager
    from prime_core.specs import Applied

    backend = config.kernels.get("fp8_linear", "auto")
    key = "trainer.model.kernels.fp8_linear" if "fp8_linear" in config.kernels else "trainer.model.quantization"
    spec = get_plugin_manager().select("kernels", f"fp8_linear:{backend}", key=key, shown=backend)
    cache = caches_weights(config, 1 if world is None else world.size)
    if not spec.impl(model, fp8_wgrad=config.fp8_wgrad, cache_weight=cache):
        raise PluginError("trainer.model.quantization = 'fp8': the model has no block linear layers "
                          "(q_proj ... down_proj) to convert", hint="unset trainer.model.quantization")
    if not cache:
        return model
    from prime_plugin_fp8.weight_cache import CACHE

    # The trainer says when a step's passes end and its update comes (weight_cache's docstring).
    return Applied(model, before_backward=CACHE.before_backward, before_step=CACHE.before_step)
