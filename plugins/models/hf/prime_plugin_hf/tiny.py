"""Build a small causal LM and its tokenizer locally, in Hugging Face format.

Nothing is downloaded: the tokenizer is a byte-level one built with the ``tokenizers``
library (one token per byte, so every character of ASCII text is one token, which suits
character-level tasks such as reversing text), with a ChatML chat template; the model is a
randomly initialised Qwen3. The folder loads through the same code path as any checkpoint
(``AutoTokenizer`` / ``AutoModelForCausalLM`` / vLLM).
"""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# vLLM's CPU attention kernels support these head sizes only.
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )


def build_tiny(out: str | Path, *, hidden_size: int = 128, num_layers: int = 2, num_heads: int = 4,
               num_kv_heads: int = 2, head_dim: int = 32, intermediate_size: int | None = None,
               max_position_embeddings: int = 4096, dtype: str = "float32", seed: int = 0,
               num_experts: int = 0, experts_per_token: int = 2, moe_intermediate_size: int | None = None) -> Path:
    """Write a tiny Qwen3 model (Qwen3-MoE with ``num_experts`` > 0) plus tokenizer to ``out``
    and return the folder."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    if head_dim not in VLLM_CPU_HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not served by vLLM on CPU; use one of {VLLM_CPU_HEAD_DIMS}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    out = Path(out)
    tokenizer = build_tokenizer()
    vocab_size = -(-len(tokenizer) // 64) * 64  # round up: friendlier matrix shapes
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|pad|>")
    shape = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim, max_position_embeddings=max_position_embeddings, tie_word_embeddings=True,
        eos_token_id=eos, pad_token_id=pad, bos_token_id=None,
    )
    if num_experts:
        if not 0 < experts_per_token <= num_experts:
            raise ValueError(f"experts_per_token ({experts_per_token}) must be between 1 and "
                             f"num_experts ({num_experts})")
        config = Qwen3MoeConfig(**shape, num_experts=num_experts, num_experts_per_tok=experts_per_token,
                                moe_intermediate_size=moe_intermediate_size or hidden_size // 2,
                                decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
        family = Qwen3MoeForCausalLM
    else:
        config, family = Qwen3Config(**shape), Qwen3ForCausalLM
    torch.manual_seed(seed)
    model = family(config).to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
