"""The causal LM: ``model.embed_tokens``, ``model.layers`` (``TransformerBlock``s),
``model.norm``, ``lm_head`` — transformers' names, so state dicts, LoRA targets and the
activation-checkpointing targets line up with the Hugging Face models."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from prime_core.trainer.packing import Packing
from prime_plugin_custom import families
from prime_plugin_custom.layers import MLP, Attention, RMSNorm, RotaryEmbedding, sdpa_attention
from prime_plugin_custom.moe import SparseMoE


@dataclass
class CausalLMOutput:
    logits: torch.Tensor | None = None
    """``[1, L, V]`` (``None`` when the LM head computed log-probabilities instead)."""
    logprobs: torch.Tensor | None = None
    """``[L]`` float32: log p(``targets``) (with ``targets`` and an ``lm_head_fn``)."""
    entropy: torch.Tensor | None = None
    """``[L]`` float32, no gradient."""


# FSDP finds the tensors of a module's output by flattening it as a pytree; an unregistered
# dataclass is a leaf, so the root's pre-backward hook was never attached (torch 2.11 then
# freed the tied embedding before the backward pass needed it).
torch.utils._pytree.register_dataclass(CausalLMOutput)


def _is_sparse(config, index: int) -> bool:
    # transformers' rule for which layers of a MoE model route to experts.
    return (index not in (getattr(config, "mlp_only_layers", None) or ()) and config.num_experts > 0
            and (index + 1) % config.decoder_sparse_step == 0)


class TransformerBlock(nn.Module):
    def __init__(self, config, family: families.Family, index: int, attention_fn) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        qkv_bias = getattr(config, "qkv_bias", None)
        if qkv_bias is None:
            qkv_bias = bool(getattr(config, "attention_bias", False))
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = Attention(
            hidden=config.hidden_size, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
            head_dim=families.head_dim(config), qkv_bias=qkv_bias,
            o_bias=bool(getattr(config, family.o_bias_key, False)) if family.o_bias_key else False,
            qk_norm=family.qk_norm, eps=eps, attention_fn=attention_fn,
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        if family.moe and _is_sparse(config, index):
            self.mlp = SparseMoE(
                hidden=config.hidden_size, intermediate=config.moe_intermediate_size,
                num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                norm_topk_prob=bool(config.norm_topk_prob),
                shared_intermediate=config.shared_expert_intermediate_size if family.shared_expert else None,
            )
        else:
            bias = bool(getattr(config, family.mlp_bias_key, False)) if family.mlp_bias_key else False
            self.mlp = MLP(config.hidden_size, config.intermediate_size, bias=bias)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, packing: Packing) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, packing)
        return h + self.mlp(self.post_attention_layernorm(h))


class Decoder(nn.Module):
    def __init__(self, config, family: families.Family, attention_fn) -> None:
        super().__init__()
        pad = getattr(config, "pad_token_id", None)
        # As transformers: the padding token's embedding row gets no gradient.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         padding_idx=pad if pad is not None and 0 <= pad < config.vocab_size else None)
        self.layers = nn.ModuleList(TransformerBlock(config, family, i, attention_fn)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(families.rope_parameters(config), families.head_dim(config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, packing: Packing) -> torch.Tensor:
        """``[L]`` token ids and positions -> ``[L, H]`` final hidden states."""
        if packing.contiguous:  # a host sync unless the host knew the starts: here, not inside a compiled block
            packing.segments()
            prepare = getattr(self.layers[0].self_attn.attention_fn, "prepare", None) if len(self.layers) else None
            if prepare is not None:
                prepare(packing)
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, packing)
        return self.norm(h)


class CausalLM(nn.Module):
    """A native implementation of the ``families.FAMILIES`` architectures.

    ``model(input_ids=[1, L], position_ids=[1, L], packing=None)`` -> ``.logits [1, L, V]``;
    without ``packing`` the samples of the row are read from ``position_ids`` (restarting at
    0). transformers' ``attention_mask`` / ``use_cache`` are accepted and ignored.

    With an ``lm_head_fn`` (the core sets one from the kernel registry when
    ``trainer.model.fused_lm_head_token_chunk_size`` is on) and ``targets [L]``, the forward
    returns ``.logprobs`` and ``.entropy`` instead, computed by
    ``lm_head_fn(hidden [L, H], lm_head.weight, targets, temperature, with_entropy=...)`` without
    the full logits; it runs inside the forward so that data-parallel wrappers see the LM
    head's weight as used there."""

    _no_split_modules: ClassVar[list[str]] = ["TransformerBlock"]
    accepts_packing = True
    lm_head_fn = None

    def __init__(self, config, attention_fn=sdpa_attention) -> None:
        super().__init__()
        family = families.family(config)
        self.config = config
        self.family = family
        self.generation_config = None
        self.model = Decoder(config, family, attention_fn)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    @property
    def tied(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", False))

    def tie_weights(self) -> None:
        if self.tied and self.lm_head.weight is not self.model.embed_tokens.weight:
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def init_buffers(self) -> None:
        """Recompute the buffers no checkpoint holds (rotary frequencies)."""
        self.model.rotary_emb.reset()

    def to_empty(self, *, device, recurse: bool = True):
        # Fresh storage unties the embeddings and leaves the rotary frequencies undefined.
        super().to_empty(device=device, recurse=recurse)
        self.tie_weights()
        self.init_buffers()
        return self

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                packing: Packing | None = None, targets: torch.Tensor | None = None, temperature=1.0,
                with_entropy: bool = True, **ignored) -> CausalLMOutput:
        if input_ids.dim() == 2 and input_ids.shape[0] != 1:
            raise ValueError(f"{type(self).__name__} takes one packed row ([1, L]), got input_ids "
                             f"{tuple(input_ids.shape)}")
        ids = input_ids.reshape(-1)
        positions = (position_ids.reshape(-1) if position_ids is not None
                     else torch.arange(ids.numel(), device=ids.device))
        if packing is None:
            packing = Packing.from_position_ids(positions)
        hidden = self.model(ids, positions, packing)
        if targets is not None and self.lm_head_fn is not None:
            logprobs, entropy = self.lm_head_fn(hidden, self.lm_head.weight, targets, temperature,
                                                 with_entropy=with_entropy)
            return CausalLMOutput(logprobs=logprobs, entropy=entropy)
        return CausalLMOutput(logits=self.lm_head(hidden[None]))  # not a view: FSDP hooks the output

    def save_pretrained(self, path, state_dict: dict | None = None, safe_serialization: bool = True,
                        **_ignored) -> None:
        """Write a Hugging Face folder (``config.json``, ``generation_config.json`` when the
        source had one, safetensors in the hub layout). ``state_dict`` is in this model's names
        (wrapper name parts allowed); ``None`` saves the model's own tensors."""
        from prime_plugin_custom.checkpoint import save_hf

        save_hf(self, Path(path), state_dict)
