"""A CPU stand-in for flash-attention 3's ``flash_attn_interface`` (tests only). Its varlen
function takes ``seqused_q``/``seqused_k`` after the lengths, as flash-attention 3 does, and
returns ``(out, softmax_lse)`` as the early flash-attention 3 releases did."""

import torch
from flash_attn import attend


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                           seqused_k=None, softmax_scale=None, causal=False, **unused):
    out = attend(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal)
    return out, torch.zeros(q.shape[1], q.shape[0], device=q.device)
