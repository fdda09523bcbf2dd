"""A CPU stand-in for flash-attention 4's ``flash_attn.cute`` (tests only): its fixed-length and
varlen functions with flash-attention 4's keywords (``qv`` before the boundaries), each returning
``(out, lse)`` as flash-attention 4 does."""

import torch

from flash_attn import attend


def flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                           max_seqlen_k=None, softmax_scale=None, causal=False, **unused):
    assert qv is None
    out = attend(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal)
    return out, torch.zeros(q.shape[1], q.shape[0], device=q.device)


def flash_attn_func(q, k, v, qv=None, softmax_scale=None, causal=False, **unused):
    assert qv is None and q.dim() == 4, "batch, sequence, heads, head dim"
    batch, length = q.shape[:2]
    cu = torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=q.device)
    out = attend(*(t.flatten(0, 1) for t in (q, k, v)), cu, cu, length, length, softmax_scale, causal)
    return out.view(q.shape), torch.zeros(batch, q.shape[2], length, device=q.device)
