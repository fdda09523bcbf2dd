"""The ``fused_lm_head`` strategy (``lm_head`` slot, first in the build order): give a native
model the LM head ``trainer.model.kernels.lm_head`` names, so that it returns per-token
log-probabilities and entropies instead of logits (``model.lm_head_fn``, which
``prime_core.trainer.model.predicted_logprobs`` calls)."""

from __future__ import annotations

import functools


def apply(model, *, config, **_):
    from prime_core.errors import PluginError
    from prime_core.plugins import get_plugin_manager

    setting = config.fused_lm_head_token_chunk_size
    if not hasattr(model, "lm_head_fn"):
        raise PluginError(
            f"trainer.model.fused_lm_head_token_chunk_size = {setting!r}: the {type(model).__name__} model "
            "computes its own logits; the fused LM head needs a native implementation",
            hint="set trainer.model.impl = 'custom' (supported families) or fused_lm_head_token_chunk_size = "
                 "'disabled'",
        )
    name = config.kernels.get("lm_head", "fused")
    key = "trainer.model.kernels.lm_head" if "lm_head" in config.kernels else \
        "trainer.model.fused_lm_head_token_chunk_size"
    spec = get_plugin_manager().select("kernels", f"lm_head:{name}", key=key, shown=name)
    # The kernel's contract: impl(hidden, weight, targets, temperature, *, token_chunk, with_entropy),
    # token_chunk an int or "auto" (sized per call from the shapes).
    model.lm_head_fn = functools.partial(spec.impl, token_chunk=setting)
    return model
