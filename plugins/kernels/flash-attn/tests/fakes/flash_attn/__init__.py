"""A CPU stand-in for flash-attn 2's varlen API, for tests only: it checks the arguments the
plugin passes (int32 boundaries, the longest sequence, keyword names) and computes attention
from ``cu_seqlens`` alone, in float32, with the documented semantics (causal aligned to the
bottom right of each sequence, GQA by head groups). It does not test flash-attention itself."""

from itertools import pairwise

import torch

__version__ = "2.99.0+fake"
calls = []


def attend(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
    assert cu_seqlens_q.device == q.device
    q_bounds, k_bounds = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    assert q_bounds[0] == 0 and q_bounds[-1] == q.shape[0] and k_bounds[-1] == k.shape[0]
    assert max_seqlen_q == max(b - a for a, b in pairwise(q_bounds))
    assert max_seqlen_k == max(b - a for a, b in pairwise(k_bounds))
    calls.append({"cu": q_bounds, "max": max_seqlen_q, "scale": softmax_scale, "causal": causal})
    group = q.shape[1] // k.shape[1]
    pieces = []
    for (qa, qb), (ka, kb) in zip(pairwise(q_bounds), pairwise(k_bounds), strict=True):
        qs = q[qa:qb].float()
        ks, vs = (t[ka:kb].float().repeat_interleave(group, dim=1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * softmax_scale
        if causal:
            lq, lk = qb - qa, kb - ka
            keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(diagonal=lk - lq)
            scores = scores.masked_fill(~keep, float("-inf"))
        pieces.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs).to(q.dtype))
    return torch.cat(pieces)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, **unused):
    assert dropout_p == 0.0
    return attend(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal)
