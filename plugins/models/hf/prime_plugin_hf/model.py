"""The ``hf`` model implementation: any transformers causal LM, from a local folder or the hub."""

from __future__ import annotations

from prime_core.config.shared import local_folder_missing


def build(model_config, *, device: str = "cpu"):
    """The policy for ``trainer.model`` (its ``name``, ``dtype``, ``attn``, ``trust_remote_code``).
    ``device = "meta"``: the structure only, no weights read (the core loads them into shards)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    name = model_config.name
    if local_folder_missing(name):
        raise FileNotFoundError(f"trainer.model.name: model folder not found: {name}")
    attn = "sdpa" if model_config.attn in ("sdpa", "auto") else model_config.attn
    if device == "meta":
        config = AutoConfig.from_pretrained(name, trust_remote_code=model_config.trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, model_config.dtype),
                                                     attn_implementation=attn,
                                                     trust_remote_code=model_config.trust_remote_code)
        return patch(model, model_config)
    model = AutoModelForCausalLM.from_pretrained(
        name, dtype=getattr(torch, model_config.dtype), attn_implementation=attn,
        trust_remote_code=model_config.trust_remote_code,
    )
    return patch(model, model_config).to(device)


NATIVE_OPS = ("rmsnorm", "swiglu", "rope")
"""Ops the custom implementation's layers call (prime-plugin-custom); a transformers model has no hook for them."""


def patch(model, model_config):
    """``trainer.model.kernels = {hf_patch = NAME}``: the ``hf_patch:NAME`` kernel rewrites the
    transformers model in place (liger's RMSNorm, SwiGLU, RoPE); other ops are native-only."""
    kernels = dict(getattr(model_config, "kernels", None) or {})
    name = kernels.pop("hf_patch", None)
    native = sorted(set(kernels) & set(NATIVE_OPS))
    if native:
        from prime_core.errors import ConfigError

        raise ConfigError([f"trainer.model.kernels.{op}: this op is run by native models (impl = 'custom'); the hf "
                           "implementation takes hf_patch instead (e.g. hf_patch = 'liger')" for op in native])
    if name is None:
        return model
    from prime_core.plugins import get_plugin_manager

    spec = get_plugin_manager().select("kernels", f"hf_patch:{name}", key="trainer.model.kernels.hf_patch", shown=name)
    return spec.impl(model) or model


def memory(model, model_config):
    """``ModelImpl.memory``: transformers' decoder blocks, counted by
    ``prime_core.memory.decoder_block_profile`` (the attention output is copied by its
    transpose and reshape before ``o_proj``)."""
    from prime_core.memory import generic_profiles

    return generic_profiles(model, model_config)
