"""Tiny random checkpoints of every supported family, written by transformers itself, for
tests here and in the plugins that parallelise this implementation (EP, CP)."""

from __future__ import annotations

from pathlib import Path

_COMMON = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
           "rms_norm_eps": 1e-6}
_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "num_hidden_layers": 3}
DEFAULTS = {
    "Qwen3ForCausalLM": {"tie_word_embeddings": True, "pad_token_id": 3},
    "LlamaForCausalLM": {
        "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}},
    "Qwen3MoeForCausalLM": {**_MOE, "mlp_only_layers": [1], "norm_topk_prob": True, "tie_word_embeddings": False},
    "Qwen2MoeForCausalLM": {**_MOE, "decoder_sparse_step": 2, "norm_topk_prob": False,
                            "shared_expert_intermediate_size": 48, "qkv_bias": True, "tie_word_embeddings": True},
}
"""Per family, settings that exercise its options: tied embeddings, biases, llama3 rope
(all three frequency bands at head_dim 16), dense layers between MoE layers, renormalised
and raw top-k weights, the shared expert."""


def tiny_config(architecture: str, **overrides):
    """A transformers config of ``architecture`` (``DEFAULTS``' keys), small enough for CPU tests."""
    import transformers

    model_class = getattr(transformers, architecture)
    kwargs = {**_COMMON, **DEFAULTS[architecture], **overrides}
    config = model_class.config_class(**kwargs)
    config.architectures = [architecture]
    return config


def randomise(model, seed: int = 0, std: float = 0.1) -> None:
    """Every parameter random, norms around 1, so that each one changes the output."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * std
            param.copy_(1 + noise if "norm" in name.rsplit(".", 2)[-2] else noise)


def save_tiny(folder: str | Path, architecture: str, *, seed: int = 0, dtype: str = "float32", **overrides) -> Path:
    """Write a random tiny ``architecture`` checkpoint with transformers' ``save_pretrained``
    (the hub layout) and return the folder."""
    import torch
    import transformers

    config = tiny_config(architecture, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config)
    randomise(model, seed)
    model.to(getattr(torch, dtype)).save_pretrained(folder)
    return Path(folder)
