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


def memory(est, config) -> None:
    """``prime plan``: no full logits unless ``"auto"`` keeps them (``chunking.keeps_logits``);
    one chunk's working set (``chunking.bytes_per_token`` times the chunk, the Triton kernels' on
    GPUs unless ``kernels.lm_head`` picks the PyTorch ones) plus the float32 gradient accumulators
    of the backward pass (``chunking.accumulator_bytes``). Kept logits replace both for the
    Triton kernels (one tile, worked in place) and come on top of them for the PyTorch ones."""
    from prime_plugin_fused_lm_head.chunking import (
        DEFAULT_BUDGET_BYTES,
        accumulator_bytes,
        bytes_per_token,
        keeps_logits,
    )

    setting = config.fused_lm_head_token_chunk_size
    rows = 2 if config.kernels.get("lm_head", "fused") == "fused_torch" else 0

    class _Dtype:  # chunking reads only the itemsize
        itemsize = est.compute_bytes

    def kept(e) -> bool:
        return setting == "auto" and keeps_logits(e.tokens, e.vocab, _Dtype)

    def head(e) -> float:
        logits = float(e.tokens * e.vocab * est.compute_bytes) if kept(e) else 0.0
        if logits and not rows:
            return logits + 16.0 * e.tokens
        per_token = bytes_per_token(e.vocab, e.hidden, _Dtype, rows)
        # At least 1: a plan for zero tokens still sizes a chunk.
        chunk = max(1, min(e.tokens, setting if isinstance(setting, int) else DEFAULT_BUDGET_BYTES // per_token))
        return (logits + chunk * per_token + accumulator_bytes(e.tokens, e.vocab, e.hidden, chunk, e.vocab)
                + 16.0 * e.tokens)

    est.lm_head = head
    est.lm_head_name = (f"fused ({'auto' if setting == 'auto' else setting} token chunks"
                        f"{', logits kept for backward' if kept(est) else ''})")
