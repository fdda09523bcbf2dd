"""Hooks of prime-plugin-deepep: the ``deepep`` EP backend (``trainer.model.ep_comm_backend =
"deepep"``), available where ``deep_ep`` is installed and CUDA GPUs are visible.

Importing this module stays cheap: neither torch nor deep_ep is imported until needed.
"""

from __future__ import annotations

from prime_core import hookimpl
from prime_core.specs import ConfigSection, EPBackend

PRIME_PLUGIN_API = 1

# No pip extra on purpose: the 'deep-ep' package on PyPI is an early snapshot that does not build.
INSTALL_HINT = "build it from https://github.com/deepseek-ai/DeepEP (needs CUDA and NVSHMEM)"


def unavailable_reason() -> str | None:
    """``None`` where DeepEP can run; otherwise why not, with what to do about it."""
    import importlib.util

    if importlib.util.find_spec("deep_ep") is None:
        return f"deep_ep is not installed: {INSTALL_HINT}"
    import torch

    if not torch.cuda.is_available():
        return "DeepEP needs CUDA GPUs and torch sees none here; use ep_comm_backend = 'torch' on this machine"
    try:
        import deep_ep  # noqa: F401
    except Exception as exc:  # a build against another CUDA/torch fails here, not at find_spec
        return f"deep_ep is installed but does not import ({type(exc).__name__}: {exc}): {INSTALL_HINT}"
    return None


@hookimpl
def prime_config_sections():
    return [ConfigSection(name="trainer.model", model="prime_plugin_deepep.config:DeepEPKeys", merge=True,
                          roots=("rl", "sft"))]


@hookimpl
def prime_ep_backends():
    return [EPBackend(name="deepep", make="prime_plugin_deepep.dispatch:make", available=unavailable_reason,
                      description="DeepEP normal kernels (NVLink intranode, RDMA internode)")]


@hookimpl
def prime_validate_config(config, root):
    from prime_core.config.shared import model_section

    model, key = model_section(config, root)
    if getattr(model, "ep", 1) <= 1 or getattr(model, "ep_comm_backend", None) != "deepep":
        return None
    if model.deepep_num_sms is not None and model.deepep_num_sms % 2:
        sms = model.deepep_num_sms
        return [f"{key}.deepep_num_sms = {sms}: DeepEP needs an even number of SMs; use {sms + 1} or {sms - 1}"]
    return None
