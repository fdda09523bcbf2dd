"""liger-kernel on a Hugging Face model instance, through liger's own per-architecture patch
functions (``liger_kernel.transformers.apply_liger_kernel_to_<type>``)."""

from __future__ import annotations

import inspect

PATCHERS = {
    "llama": "apply_liger_kernel_to_llama",
    "qwen2": "apply_liger_kernel_to_qwen2",
    "qwen3": "apply_liger_kernel_to_qwen3",
    "qwen3_moe": "apply_liger_kernel_to_qwen3_moe",
}
"""``config.model_type`` -> the liger function that patches it."""


def apply_to_hf(model, *, rope: bool = True, rms_norm: bool = True, swiglu: bool = True):
    """Swap liger's RMSNorm, SwiGLU MLP and RoPE into ``model`` (a transformers causal LM of a
    ``PATCHERS`` type, on any device, meta included) and return it.

    liger's cross-entropy patches stay off: prime computes log-probabilities from the logits
    itself, and liger's fused-linear-cross-entropy forward only applies when labels are passed.
    Note that liger patches RoPE (and the classes used by models built later) at the level of
    the transformers modeling module, so every model of that type in the process gets it."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    name = PATCHERS.get(model_type)
    if name is None:
        raise ValueError(f"liger: no patch for model type {model_type!r}; supported: {', '.join(sorted(PATCHERS))}")
    import liger_kernel.transformers as liger_transformers

    patch = getattr(liger_transformers, name, None)
    if patch is None:
        raise ValueError(f"liger: the installed liger-kernel has no {name}: pip install -U liger-kernel")
    accepted = inspect.signature(patch).parameters
    if "model" not in accepted:
        raise ValueError(f"liger: {name} of the installed liger-kernel cannot patch a model instance: "
                         "pip install -U liger-kernel")
    options = {"rope": rope, "rms_norm": rms_norm, "swiglu": swiglu, "cross_entropy": False,
               "fused_linear_cross_entropy": False, "model": model}
    patch(**{key: value for key, value in options.items() if key in accepted})
    return model
