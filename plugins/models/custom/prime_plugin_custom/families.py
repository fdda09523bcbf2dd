"""Which checkpoints the custom implementation reproduces exactly, read from their HF config.

Imports nothing heavy: ``supports`` runs while ``impl = "auto"`` is resolved.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    architecture: str
    qk_norm: bool
    """RMSNorm over each head of q and k before the rotary embedding (Qwen3)."""
    moe: bool
    shared_expert: bool
    """A dense expert beside the routed ones, gated by ``sigmoid(shared_expert_gate(x))``."""
    o_bias_key: str | None
    """The config key that gives ``o_proj`` a bias (Qwen2-MoE's o_proj never has one)."""
    mlp_bias_key: str | None


FAMILIES = {f.architecture: f for f in (
    Family("Qwen3ForCausalLM", qk_norm=True, moe=False, shared_expert=False, o_bias_key="attention_bias",
           mlp_bias_key=None),
    Family("LlamaForCausalLM", qk_norm=False, moe=False, shared_expert=False, o_bias_key="attention_bias",
           mlp_bias_key="mlp_bias"),
    Family("Qwen3MoeForCausalLM", qk_norm=True, moe=True, shared_expert=False, o_bias_key="attention_bias",
           mlp_bias_key=None),
    Family("Qwen2MoeForCausalLM", qk_norm=False, moe=True, shared_expert=True, o_bias_key=None,
           mlp_bias_key=None),
)}
SUPPORTED = tuple(FAMILIES)
# Configs written without ``architectures`` still name their model type.
_BY_MODEL_TYPE = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                  "qwen2_moe": "Qwen2MoeForCausalLM"}
ROPE_TYPES = ("default", "linear", "llama3")


def architecture(config) -> str:
    names = getattr(config, "architectures", None) or []
    if names:
        return names[0]
    return _BY_MODEL_TYPE.get(getattr(config, "model_type", None), str(getattr(config, "model_type", "unknown")))


def rope_parameters(config) -> dict:
    """``rope_type``, ``rope_theta`` and the scaling keys, from transformers 5's
    ``rope_parameters`` or the older ``rope_theta`` + ``rope_scaling``."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None)
    if not params and isinstance(legacy, dict):
        params = dict(legacy)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def unsupported_reason(config) -> str | None:
    """``None`` when the custom implementation computes exactly what transformers does for this
    config, else what stands in the way."""
    arch = architecture(config)
    family = FAMILIES.get(arch)
    if family is None:
        return f"architecture {arch} is not implemented"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"{arch} with hidden_act = {config.hidden_act!r} (only 'silu' is implemented)"
    if getattr(config, "use_sliding_window", False) or "sliding_attention" in (getattr(config, "layer_types", None)
                                                                                or ()):
        return f"{arch} with sliding-window attention (only full causal attention is implemented)"
    rope = rope_parameters(config)
    if rope["rope_type"] not in ROPE_TYPES:
        return f"{arch} with rope type {rope['rope_type']!r} (implemented: {', '.join(ROPE_TYPES)})"
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        return f"{arch} with partial_rotary_factor = {rope['partial_rotary_factor']} (only 1.0 is implemented)"
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) != 0.0:
        return f"{arch} with attention_dropout = {config.attention_dropout} (only 0 is implemented)"
    if config.num_attention_heads % config.num_key_value_heads:
        return f"{arch} with {config.num_attention_heads} heads over {config.num_key_value_heads} kv heads"
    return None


def supports(config) -> bool:
    return unsupported_reason(config) is None


def family(config) -> Family:
    """The family of a supported config; ``ConfigError`` (naming the fix) otherwise."""
    reason = unsupported_reason(config)
    if reason is not None:
        from prime_core.errors import ConfigError

        raise ConfigError([
            (f"trainer.model.impl = 'custom': {reason}. The custom implementation supports "
             f"{', '.join(SUPPORTED)}; set trainer.model.impl = 'hf' (or 'auto', which falls back to hf) "
             "for this checkpoint")
        ])
    return FAMILIES[architecture(config)]
