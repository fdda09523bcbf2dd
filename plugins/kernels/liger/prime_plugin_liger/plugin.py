"""Hooks of prime-plugin-liger: liger-kernel's Triton RMSNorm, SwiGLU, RoPE and fused linear
cross-entropy as kernels a model looks up by op (``rmsnorm:liger``, ``swiglu:liger``,
``rope:liger``, ``lm_head:liger``), and ``hf_patch:liger``, liger's own patching of a Hugging
Face model instance. Call signatures: README.md.

All are available where liger_kernel and triton are installed and CUDA is visible. Importing
this module stays cheap: neither torch nor liger is imported until a check or a kernel runs.
"""

from __future__ import annotations

from prime_core import hookimpl
from prime_core.specs import Kernel

PRIME_PLUGIN_API = 1

INSTALL_HINT = "pip install liger-kernel"


def unavailable_reason() -> str | None:
    """``None`` where liger's kernels can run; otherwise why not, with what to do about it."""
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is None:
        return f"liger_kernel is not installed: {INSTALL_HINT}"
    if importlib.util.find_spec("triton") is None:
        return f"triton is not installed (liger-kernel's kernels are Triton): pip install triton, or {INSTALL_HINT}"
    import torch

    if not torch.cuda.is_available():
        return "liger-kernel's Triton kernels need a CUDA GPU and torch sees none here; leave the liger kernels off"
    try:
        import liger_kernel.transformers.functional  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - a release for another torch/triton fails here, not at find_spec
        return (f"liger_kernel is installed but does not import ({type(exc).__name__}: {exc}): "
                f"{INSTALL_HINT} (a release matching this torch and triton)")
    return None


@hookimpl
def prime_kernels():
    def kernel(op, impl, reference, description):
        return Kernel(op=op, name="liger", impl=impl, available=unavailable_reason, reference=reference,
                      description=description)

    return [
        kernel("rmsnorm", "prime_plugin_liger.ops:rmsnorm", "prime_plugin_custom.layers.RMSNorm.forward",
               "liger Triton RMSNorm: rmsnorm(x [..., H], weight [H], eps)"),
        kernel("swiglu", "prime_plugin_liger.ops:swiglu", "F.silu(gate) * up",
               "liger Triton SiLU-and-multiply: swiglu(gate, up)"),
        kernel("rope", "prime_plugin_liger.ops:rope", "prime_plugin_custom.layers.apply_rotary on q and k",
               "liger Triton RoPE: rope(q [L, Hq, D], k [L, Hkv, D], cos [L, D], sin [L, D]) -> (q, k)"),
        kernel("lm_head", "prime_plugin_liger.lm_head:liger_logprobs",
               "eager logits + log_softmax (lm_head:fused's contract, no entropy)",
               "liger fused linear cross-entropy as per-token log p(target); SFT only (no entropy)"),
        kernel("hf_patch", "prime_plugin_liger.hf:apply_to_hf", "the unpatched transformers model",
               "liger's apply_liger_kernel_to_<type> on a transformers model (llama, qwen2, qwen3, qwen3_moe)"),
    ]
