"""``attn_implementation = "prime_varlen"``: continuous batching on the flash-attention 2
varlen kernel that ships inside torch's CUDA builds, for GPUs without the ``flash_attn`` package
or network access to the kernels hub (the lent GPU image has neither).

Why: transformers' paged ``sdpa`` path attends over one dense mask of every query token of the
batch against every cached token of the batch, so a decode step of 256 sequences of 300 tokens
computes 256 x 76,800 scores per head and layer where 300 per sequence are needed; it is the
step's cost (on one H100, the 0.6B shape: 2,027 tokens/s at 256 concurrent samples). For an
implementation that is neither ``sdpa`` nor ``eager`` the manager builds no mask and passes the
sequence boundaries (``cu_seq_lens_q`` / ``cu_seq_lens_k``), which is all a varlen kernel needs.
The name must not contain "flash": transformers would then try to import a flash-attention
package or hub kernel for it. Not being "flash", the manager leaves CUDA graphs off by default,
so ``cb_config.settings`` turns them on. This module is only the call: the paged cache is read
and written by transformers' own ``cache.update``, whose signature changed in 5.19 (both are
handled). The manager's block-table decode path needs ``flash_attn_with_kvcache``, which torch
does not ship, so every step takes the varlen path.

A plain forward pass of the model (no paged cache: the engine's greedy rescoring) runs
transformers' own ``sdpa``.
"""

from __future__ import annotations

import inspect

NAME = "prime_varlen"


def unavailable_reason(dtype) -> str | None:
    """Why this implementation cannot serve a model of ``dtype`` here (``None``: it can)."""
    import torch

    if not torch.cuda.is_available():
        return "it needs a CUDA GPU"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"flash attention has no {str(dtype).removeprefix('torch.')} kernels (bfloat16 or float16 only)"
    if torch.cuda.get_device_capability() < (8, 0):
        return "torch's flash attention needs a GPU of compute capability 8.0 or newer"
    if not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return "this torch build has no flash attention"
    return None


def register() -> None:
    """Make ``NAME`` a transformers attention implementation (idempotent). transformers < 5.19
    switches a continuous-batching model to ``paged|<name>``, so that name is registered too."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention)
    AttentionInterface.register(f"paged|{NAME}", attention)
    _size_the_cache_without_masks()


def uses_this(config=None, requested_attention_implementation=None, **_) -> bool:
    """Whether a model config (or an implementation name) asks for this implementation."""
    name = requested_attention_implementation or getattr(config, "_attn_implementation", None) or ""
    return name.removeprefix("paged|") == NAME


def _size_the_cache_without_masks() -> None:
    """The paged cache's sizing counts an attention mask of every batch token against every
    cached token unless flash attention is requested (``is_flash_attention_requested`` in
    transformers' ``continuous_batching/cache.py``), but the manager builds masks only for
    ``eager`` and ``sdpa`` (``attn_mask_is_needed``): this implementation gets none. Counted,
    that mask takes the share meant for the KV cache (on an H200 at 0.25, a small model got a
    1.6 GiB cache out of 35 GiB). The sizing's check is answered for this name as for flash;
    every other name, and the rest of transformers, is left as it was."""
    from transformers.generation.continuous_batching import cache

    original = getattr(cache, "is_flash_attention_requested", None)
    if original is None or getattr(original, "prime_varlen_aware", False):
        return

    def is_flash_attention_requested(config=None, requested_attention_implementation=None, version=None):
        if version is None and uses_this(config, requested_attention_implementation):
            return True
        return original(config=config, requested_attention_implementation=requested_attention_implementation,
                        version=version)

    is_flash_attention_requested.prime_varlen_aware = True
    cache.is_flash_attention_requested = is_flash_attention_requested


def _per_layer(value, module):
    """``cu_seq_lens_k`` / ``max_seqlen_k`` come per layer type when a model mixes them."""
    if isinstance(value, dict):
        return value["sliding_attention" if getattr(module, "sliding_window", None) else "full_attention"]
    return value


def attention(module, query, key, value, attention_mask, scaling=None, sliding_window=None, cache=None, **kwargs):
    """q ``[1, H, Tq, D]``, k/v ``[1, Hkv, Tk, D]`` (this step's tokens) -> ``[Tq, H, D]``."""
    import torch

    if cache is None or kwargs.get("cu_seq_lens_q") is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    if sliding_window or getattr(module, "sliding_window", None):
        raise NotImplementedError(f"attn_implementation {NAME!r} serves full-attention layers only; this model has "
                                  "sliding-window layers: use inference.args.attn_implementation = 'sdpa'")
    if "kwargs" in inspect.signature(cache.update).parameters:  # transformers >= 5.19: [1, Hkv, T, D] back
        key, value = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx, kwargs=kwargs)
        key, value = key[0].transpose(0, 1), value[0].transpose(0, 1)
        max_q, max_k = kwargs["max_length_q"], kwargs["max_length_k"]
    else:  # 5.17: [T, Hkv, D] back
        key, value = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                                  read_index=kwargs["read_index"], write_index=kwargs["write_index"])
        max_q, max_k = kwargs["max_seqlen_q"], _per_layer(kwargs["max_seqlen_k"], module)
    cu_q = kwargs["cu_seq_lens_q"].to(torch.int32)
    cu_k = _per_layer(kwargs["cu_seq_lens_k"], module).to(torch.int32)
    q = query[0].transpose(0, 1)
    # Causal attention is aligned bottom-right: a decode query sees its whole sequence.
    out = torch.ops.aten._flash_attention_forward(
        q.contiguous(), key.contiguous(), value.contiguous(), cu_q, cu_k, int(max_q), int(max_k), 0.0, True, False,
        scale=scaling if scaling is not None else module.scaling)[0]
    return out, None
