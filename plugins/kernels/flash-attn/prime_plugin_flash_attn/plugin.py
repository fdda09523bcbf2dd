"""Hooks of prime-plugin-flash-attn: flash-attention 2 and 3 (varlen) as the attention kernel,
``attention:flash_attention_2`` and ``attention:flash_attention_3``, and torch's bundled copy of
flash-attention 2's varlen kernel, ``attention:torch_flash``, and ``attention:torch_fused`` (cuDNN
for one-sample rows, torch_flash for packed ones; neither needs a package), selected by
``trainer.model.attn`` for native models (``impl = "custom"``).

Each is available where its package imports and CUDA is visible. Importing this module stays
cheap: neither torch nor flash-attention is imported until a check or the kernel runs.
"""

from __future__ import annotations

from prime_core import hookimpl
from prime_core.specs import Kernel

PRIME_PLUGIN_API = 1

FA2_HINT = ("pip install flash-attn --no-build-isolation (prebuilt wheels per torch/CUDA version: "
            "https://github.com/Dao-AILab/flash-attention/releases)")
FA3_HINT = ("build it from the hopper/ folder of https://github.com/Dao-AILab/flash-attention "
            "(cd hopper && python setup.py install; Hopper GPUs, CUDA >= 12.3)")


def _unavailable(module: str, what: str, hint: str, function: str = "flash_attn_varlen_func") -> str | None:
    import importlib
    import importlib.util

    if importlib.util.find_spec(module) is None:
        return f"{module} is not installed ({what}): {hint}"
    import torch

    if not torch.cuda.is_available():
        return f"{what} needs a CUDA GPU and torch sees none here; use trainer.model.attn = 'sdpa' on this machine"
    try:
        loaded = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - a build for another torch/CUDA fails here, not at find_spec
        return f"{module} is installed but does not import ({type(exc).__name__}: {exc}): {hint}"
    if not hasattr(loaded, function):
        version = getattr(loaded, "__version__", "?")
        return f"{module} {version} has no {function} (the varlen API of {what}): {hint}"
    return None


def flash_attention_2_unavailable() -> str | None:
    """``None`` where flash-attention 2 can run; otherwise why not, with the fix."""
    return _unavailable("flash_attn", "flash-attention 2", FA2_HINT)


def flash_attention_3_unavailable() -> str | None:
    """``None`` where flash-attention 3 can run; otherwise why not, with the fix."""
    return _unavailable("flash_attn_interface", "flash-attention 3", FA3_HINT)


def torch_flash_unavailable() -> str | None:
    """``None`` where torch's bundled flash-attention varlen kernel can run; otherwise why not."""
    import torch

    if not torch.cuda.is_available():
        return ("torch's flash-attention kernel needs a CUDA GPU and torch sees none here; "
                "use trainer.model.attn = 'sdpa'")
    if not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return f"torch {torch.__version__} has no aten._flash_attention_forward (built without flash attention)"
    major, _ = torch.cuda.get_device_capability()
    if major < 8:
        return (f"torch's flash-attention kernel needs an Ampere or newer GPU (compute capability 8.0+), "
                f"this one is {major}.x")
    return None


def torch_fused_unavailable() -> str | None:
    """``None`` where torch's cuDNN and flash attention kernels can run; otherwise why not."""
    reason = torch_flash_unavailable()
    if reason:
        return reason
    import torch

    if not torch.backends.cudnn.is_available() or not hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
        return f"torch {torch.__version__} has no cuDNN attention here; use trainer.model.attn = 'torch_flash'"
    return None


@hookimpl
def prime_trainer_defaults(model_config, context):
    """``attn = "auto"`` with the native model on a GPU in bf16/fp16: ``torch_fused`` (cuDNN
    for rows of one sample, 1.7x flash-attention 2 on an H200 at 8k-32k tokens; flash varlen
    for packed rows, one call instead of one per sample), where torch has both kernels
    (``prime plan`` assumes it does)."""
    if model_config.attn != "auto" or not context.fast or context.impl != "custom":
        return None
    if not context.planning and torch_fused_unavailable() is not None:  # planning: no CUDA call
        return None
    from prime_core.trainer.defaults import Choice

    return [Choice("attn", "torch_fused", "cuDNN attention for rows of one sample, flash varlen for packed rows")]


@hookimpl
def prime_kernels():
    reference = "prime_plugin_custom.layers.sdpa_attention"
    return [
        Kernel(op="attention", name="flash_attention_2", impl="prime_plugin_flash_attn.varlen:flash_attention_2",
               available=flash_attention_2_unavailable, reference=reference,
               description="flash-attention 2 varlen over a packed row's samples (bf16/fp16, GQA, whole rows)"),
        Kernel(op="attention", name="flash_attention_3", impl="prime_plugin_flash_attn.varlen:flash_attention_3",
               available=flash_attention_3_unavailable, reference=reference,
               description="flash-attention 3 (Hopper) varlen over a packed row's samples (bf16/fp16, GQA)"),
        Kernel(op="attention", name="torch_flash", impl="prime_plugin_flash_attn.torch_kernels:torch_flash",
               available=torch_flash_unavailable, reference=reference,
               description="torch's bundled flash-attention 2 varlen kernel: one call per packed row, "
                           "no extra package"),
        Kernel(op="attention", name="torch_fused", impl="prime_plugin_flash_attn.torch_kernels:torch_fused",
               available=torch_fused_unavailable, reference=reference,
               description="torch's bundled kernels, fastest per row: cuDNN for one sample, "
                           "flash varlen for packed rows"),
    ]
