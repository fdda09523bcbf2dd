"""Hooks of prime-plugin-flash-attn: flash-attention 2, 3 and 4 (varlen) as the attention kernel,
``attention:flash_attention_2``, ``_3`` and ``_4``, and torch's bundled copy of
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
FA4_HEAD_DIMS = (32, 64, 128)
"""The head dims ``attention:flash_attention_4`` was checked at against the float64 reference on
an H200 (flash-attn-4 4.0.0b36), packed rows and one-sample rows, grouped kv heads or not. At 16
its Hopper backward over packed rows gave wrong gradients (every ``dq`` off by about 100%; ``dk``,
``dv`` too with grouped heads), so dims not checked are refused rather than trusted."""
FA4_HINT = ("pip install flash-attn-4 (flash-attention 4: CuTe DSL kernels compiled at first use, for Hopper and "
            "Blackwell GPUs; it pulls nvidia-cutlass-dsl)")


def _installed(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a submodule's parent package is missing
        return False


def _unavailable(module: str, what: str, hint: str, function: str = "flash_attn_varlen_func") -> str | None:
    import importlib

    if not _installed(module):
        return f"{module} is not installed ({what}): {hint}"
    import torch

    if not torch.cuda.is_available():
        return f"{what} needs a CUDA GPU and torch sees none here; use trainer.model.attn = 'sdpa' on this machine"
    try:
        loaded = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - a build for another torch/CUDA fails here, not at find_spec
        return f"{module} is installed but does not import ({type(exc).__name__}: {exc}): {hint}"
    if not hasattr(loaded, function):
        if getattr(loaded, "__file__", None) is None:  # flash-attn-4 installs flash_attn.cute under a bare namespace
            return (f"{what} is not installed: {module} here is only a namespace for other packages' modules "
                    f"(such as flash-attention 4's {module}.cute): {hint}")
        version = getattr(loaded, "__version__", "(no version)")
        return f"{module} {version} has no {function} (the varlen API of {what}): {hint}"
    return None


def flash_attention_2_unavailable() -> str | None:
    """``None`` where flash-attention 2 can run; otherwise why not, with the fix."""
    return _unavailable("flash_attn", "flash-attention 2", FA2_HINT)


def flash_attention_3_unavailable() -> str | None:
    """``None`` where flash-attention 3 can run; otherwise why not, with the fix."""
    return _unavailable("flash_attn_interface", "flash-attention 3", FA3_HINT)


def flash_attention_4_unavailable() -> str | None:
    """``None`` where flash-attention 4 can run (a Hopper or newer GPU); otherwise why not, with the fix."""
    reason = _unavailable("flash_attn.cute", "flash-attention 4", FA4_HINT)
    if reason:
        return reason
    import torch

    major, _ = torch.cuda.get_device_capability()
    if major < 9:
        return (f"flash-attention 4 runs on Hopper and Blackwell GPUs (compute capability 9.0+), this one is "
                f"{major}.x; use trainer.model.attn = 'torch_fused'")
    return None


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


def flash_attention_4_fits(context) -> bool:
    """Whether ``auto`` takes flash-attention 4 for the native model: installed, a Hopper or newer
    GPU (``prime plan``: installed, without importing it or touching the GPU), and the model's head
    dim checked."""
    from prime_plugin_custom.families import head_dim  # the native model's plugin: context.impl == "custom"

    if context.hf_config is None or head_dim(context.hf_config) not in FA4_HEAD_DIMS:
        return False
    return _installed("flash_attn.cute") if context.planning else flash_attention_4_unavailable() is None


@hookimpl
def prime_trainer_defaults(model_config, context):
    """``attn = "auto"`` with the native model on a GPU in bf16/fp16: ``flash_attention_4`` where
    flash-attn-4 is installed and the head dim is one it was checked at (on an H200 against
    ``torch_fused``, same jobs: the dense 1.7B step at 8k tokens 1.03x on rows of one sample and
    1.35x on packed rows, the 2.9B MoE step 1.02-1.03x); else ``torch_fused`` (cuDNN for rows of
    one sample, 1.7x flash-attention 2 at 8k-32k tokens; flash varlen for packed rows, one call
    instead of one per sample), where torch has both kernels (``prime plan`` assumes it does)."""
    if model_config.attn != "auto" or not context.fast or context.impl != "custom":
        return None
    from prime_core.trainer.defaults import Choice

    if flash_attention_4_fits(context):
        return [Choice("attn", "flash_attention_4", "flash-attention 4 is installed; on an H200 it leads cuDNN and "
                                                    "flash varlen, packed rows most")]
    if not context.planning and torch_fused_unavailable() is not None:  # planning: no CUDA call
        return None
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
        Kernel(op="attention", name="flash_attention_4", impl="prime_plugin_flash_attn.varlen:flash_attention_4",
               available=flash_attention_4_unavailable, reference=reference,
               description="flash-attention 4 (CuTe DSL; Hopper, Blackwell) over a packed row's samples "
                           "(bf16/fp16, GQA)"),
        Kernel(op="attention", name="torch_flash", impl="prime_plugin_flash_attn.torch_kernels:torch_flash",
               available=torch_flash_unavailable, reference=reference,
               description="torch's bundled flash-attention 2 varlen kernel: one call per packed row, "
                           "no extra package"),
        Kernel(op="attention", name="torch_fused", impl="prime_plugin_flash_attn.torch_kernels:torch_fused",
               available=torch_fused_unavailable, reference=reference,
               description="torch's bundled kernels, fastest per row: cuDNN for one sample, "
                           "flash varlen for packed rows"),
    ]
