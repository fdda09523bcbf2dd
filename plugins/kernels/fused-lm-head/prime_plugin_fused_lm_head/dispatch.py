"""``lm_head:fused``: the Triton implementation where it applies (CUDA tensors, Triton
installed, not float64), PyTorch otherwise, decided per call."""

from __future__ import annotations


def fused_logprobs(hidden, weight, targets, temperature=1.0, *, token_chunk, vocab_chunk=None, with_entropy=True):
    import torch

    if hidden.is_cuda and hidden.dtype != torch.float64 and triton_reason() is None:
        from prime_plugin_fused_lm_head.triton_impl import fused_logprobs as impl
    else:
        from prime_plugin_fused_lm_head.torch_impl import fused_logprobs as impl
    return impl(hidden, weight, targets, temperature, token_chunk=token_chunk, vocab_chunk=vocab_chunk,
                with_entropy=with_entropy)


def triton_reason() -> str | None:
    from prime_plugin_fused_lm_head.triton_impl import unavailable_reason

    return unavailable_reason()
