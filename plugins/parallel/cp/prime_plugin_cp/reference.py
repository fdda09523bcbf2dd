"""Dense attention over a packing, the ground truth the CP kernels are tested against.

Materialises the ``[H, Lq, Lk]`` scores: for tests and short rows only."""

from __future__ import annotations


def dense_attention(q, k, v, packing, scale):
    """``attention_fn`` contract: q ``[L, Hq, D]``, k/v ``[L, Hkv, D]`` of the tokens in
    ``packing`` (any subset of a row, attending among themselves) -> ``[L, Hq, D]``."""
    import torch

    from prime_core.trainer.packing import allowed

    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    mask = allowed(packing.index, packing.segment_ids, packing.index, packing.segment_ids)
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, v)
