"""The ``hf`` model implementation: any transformers causal LM, from a local folder or the hub."""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(name: str, *, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)


def build(model_config, *, device: str = "cpu"):
    """The policy for ``trainer.model`` (its ``name``, ``dtype``, ``attn``, ``trust_remote_code``).
    ``device = "meta"``: the structure only, no weights read (the core loads them into shards)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    name = model_config.name
    if name.startswith(("/", ".", "~")) and not Path(name).expanduser().is_dir():
        raise FileNotFoundError(f"trainer.model.name: model folder not found: {name}")
    attn = "sdpa" if model_config.attn in ("sdpa", "auto") else model_config.attn
    if device == "meta":
        config = AutoConfig.from_pretrained(name, trust_remote_code=model_config.trust_remote_code)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=getattr(torch, model_config.dtype),
                                                    attn_implementation=attn,
                                                    trust_remote_code=model_config.trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(
        name, dtype=getattr(torch, model_config.dtype), attn_implementation=attn,
        trust_remote_code=model_config.trust_remote_code,
    )
    return model.to(device)
