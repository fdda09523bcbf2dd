"""``build(model_config, device=...)``: the ``custom`` model implementation's entry point."""

from __future__ import annotations

from pathlib import Path

import torch

from prime_core.config.shared import local_folder_missing
from prime_core.hub import model_folder
from prime_plugin_custom import families
from prime_plugin_custom.checkpoint import load_hf_weights
from prime_plugin_custom.layers import sdpa_attention
from prime_plugin_custom.model import CausalLM

# transformers' names for "its own attention"; all of them mean the default kernel here.
DEFAULT_ATTN = ("sdpa", "auto", "eager")


def attention_kernel(attn: str):
    """The ``attention_fn`` for ``trainer.model.attn``: the default kernel, or a kernel
    registered as ``attention:<attn>`` (same signature as ``layers.sdpa_attention``)."""
    if attn in DEFAULT_ATTN:
        return sdpa_attention
    from prime_core.plugins import get_plugin_manager

    return get_plugin_manager().select("kernels", f"attention:{attn}", key="trainer.model.attn", shown=attn).impl


# trainer.model.kernels ops a native model runs, and the attribute each kernel replaces.
OP_HOOKS = {"rmsnorm": ("RMSNorm", "norm_fn"), "swiglu": ("MLP", "swiglu_fn"), "rope": ("Attention", "rope_fn")}


def attach_kernels(model, kernels: dict[str, str]) -> None:
    """Point every RMSNorm / MLP / Attention at the kernels ``trainer.model.kernels`` names
    (``{"rmsnorm": "liger", ...}``: registered as ``rmsnorm:liger``); the eager code otherwise.
    Ops the native model does not run (``lm_head``, ``fp8_linear``) are other components'."""
    from prime_core.errors import ConfigError
    from prime_core.plugins import get_plugin_manager

    if "hf_patch" in kernels:
        raise ConfigError(["trainer.model.kernels.hf_patch: patches a transformers model (impl = 'hf'); the native "
                           f"implementation takes {', '.join(OP_HOOKS)} instead"])
    for op, name in kernels.items():
        if op not in OP_HOOKS:
            continue
        impl = get_plugin_manager().select("kernels", f"{op}:{name}", key=f"trainer.model.kernels.{op}",
                                           shown=name).impl
        cls_name, attr = OP_HOOKS[op]
        for module in model.modules():
            if type(module).__name__ == cls_name:
                setattr(module, attr, impl)


def load_config(name: str, *, trust_remote_code: bool = False):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    if not getattr(config, "architectures", None):
        config.architectures = [families.architecture(config)]
    return config


def build(model_config, *, device: str = "cpu") -> CausalLM:
    """The policy for ``trainer.model`` (``name``, ``dtype``, ``attn``, ``trust_remote_code``).

    ``device = "meta"``: the structure only (the core fills it from rank 0); otherwise the
    weights are read from the folder's safetensors and the model is moved to ``device``."""
    name = str(model_config.name)
    if local_folder_missing(name):
        raise FileNotFoundError(f"trainer.model.name: model folder not found: {name}")
    config = load_config(name, trust_remote_code=getattr(model_config, "trust_remote_code", False))
    families.family(config)  # refuses what this implementation does not reproduce, naming the fix
    attention_fn = attention_kernel(getattr(model_config, "attn", "sdpa"))
    dtype = getattr(torch, model_config.dtype)
    with torch.device("meta"):
        model = CausalLM(config, attention_fn=attention_fn)
    attach_kernels(model, getattr(model_config, "kernels", None) or {})
    model.to(dtype)
    if device == "meta":
        model.init_buffers()
        model.generation_config = generation_config(Path(name).expanduser())
        return model
    folder = model_folder(name)
    model.to_empty(device="cpu")
    load_hf_weights(model, folder)
    model.generation_config = generation_config(folder)
    return model if str(device) == "cpu" else model.to(device)


def generation_config(folder: Path):
    """The folder's generation config (republished with the weights), if it has one."""
    if not (folder / "generation_config.json").is_file():
        return None
    from transformers import GenerationConfig

    return GenerationConfig.from_pretrained(folder)


def memory(model: CausalLM, model_config) -> list:
    """``ModelImpl.memory``: each block counted by ``prime_core.memory.decoder_block_profile``
    as this implementation runs it: the attention kernel's output feeds ``o_proj`` without a
    copy, and a ``SparseMoE`` block routes each token to ``top_k`` experts."""
    from prime_core.memory import decoder_block_profile, dtype_bytes
    from prime_plugin_custom.moe import SparseMoE

    dt = dtype_bytes(model_config.dtype)
    dense = decoder_block_profile(model.config, dt, o_proj_copy=False)
    sparse = decoder_block_profile(model.config, dt, o_proj_copy=False, moe=True) if model.family.moe else None
    return [sparse if isinstance(layer.mlp, SparseMoE) else dense for layer in model.model.layers]
