"""The eager attention kernel for one (query block, key block) pair of a ring.

``block_forward`` returns the block's normalised output and log-sum-exp so that blocks can be
merged in any order; ``block_backward`` recomputes the block's probabilities from the final
(merged) log-sum-exp, the way flash attention's backward does, so nothing of size
``Lq x Lk`` outlives one query chunk. Masks come from the tokens' row ``index`` and
``segment_ids`` only (``prime_core.trainer.packing.allowed``).

Layout: q ``[Lq, Hq, D]``, k/v ``[Lk, Hkv, D]`` with query head ``h`` reading key/value head
``h // (Hq // Hkv)``; each key head's query heads are stacked into one batched matmul, so
repeated keys/values are never materialised. Scores are computed in float32 (float64 for float64
inputs) and outputs come back in that accumulation dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CHUNK_BYTES = 256 << 20
"""Query rows per chunk are chosen so that one chunk's score matrix stays below this."""


def acc_dtype(dtype):
    import torch

    return torch.promote_types(dtype, torch.float32)


def _rows_per_chunk(lq: int, lk: int, heads: int, itemsize: int, chunk_bytes: int) -> int:
    return max(1, min(lq, chunk_bytes // max(1, lk * heads * itemsize)))


def any_allowed(q_index, q_seg, k_index, k_seg):
    """``[Q, B]`` bool, exactly: may some query of group ``i`` (rows of ``q_* [Q, r]``) attend
    some key of group ``j`` (rows of ``k_* [B, Lk]``)? True iff, for some sample, the group's
    first key comes no later than the other group's last query. Costs ``O(Q + B)`` per sample,
    never ``r x Lk``."""
    import torch

    q_index, q_seg, k_index, k_seg = (t.long() for t in (q_index, q_seg, k_index, k_seg))
    segments = int(torch.maximum(q_seg.max(), k_seg.max())) + 1
    first_key = torch.full((k_index.shape[0], segments), torch.iinfo(torch.int64).max, dtype=torch.int64,
                           device=k_index.device).scatter_reduce_(1, k_seg, k_index, "amin")
    last_query = torch.full((q_index.shape[0], segments), -1, dtype=torch.int64,
                            device=q_index.device).scatter_reduce_(1, q_seg, q_index, "amax")
    return (first_key[None] <= last_query[:, None]).any(-1)


def _live_chunks(q_index, q_seg, k_index, k_seg, rows: int) -> list[bool]:
    """Per query chunk: whether any key is allowed (one host sync for all chunks). Dead chunks,
    common under the zigzag split, are skipped outright."""
    import torch

    lq = q_index.numel()
    pad = (-lq) % rows
    if pad:  # repeat the last token: it changes no chunk's answer
        q_index = torch.cat([q_index, q_index[-1:].expand(pad)])
        q_seg = torch.cat([q_seg, q_seg[-1:].expand(pad)])
    return any_allowed(q_index.reshape(-1, rows), q_seg.reshape(-1, rows), k_index[None], k_seg[None])[:, 0].tolist()


def _group(x, hkv: int):
    """``[c, Hq, ...]`` -> ``[Hkv, G * c, ...]``: each key head's query heads stacked, so one
    batched matmul per key head serves its whole group."""
    c, hq = x.shape[:2]
    return x.reshape(c, hkv, hq // hkv, *x.shape[2:]).movedim(0, 2).reshape(hkv, (hq // hkv) * c, *x.shape[2:])


def _ungroup(x, c: int):
    """``[Hkv, G * c, ...]`` -> ``[c, Hq, ...]``."""
    hkv, gc = x.shape[:2]
    return x.reshape(hkv, gc // c, c, *x.shape[2:]).movedim(2, 0).reshape(c, hkv * (gc // c), *x.shape[2:])


def _masked_scores(qg, k_t, q_index, q_seg, k_index, k_seg, scale):
    """``[Hkv, G * c, Lk]`` scaled scores, ``-inf`` where the key is not allowed."""
    import torch

    from prime_core.trainer.packing import allowed

    s = torch.bmm(qg, k_t).mul_(scale)
    hkv, gc, lk = s.shape
    mask = allowed(q_index, q_seg, k_index, k_seg)  # [c, Lk], the same for every head
    s.view(hkv, gc // mask.shape[0], mask.shape[0], lk).masked_fill_(~mask, float("-inf"))
    return s


def block_forward(q, k, v, q_index, q_seg, k_index, k_seg, scale, *, chunk_bytes: int = CHUNK_BYTES):
    """``(out [Lq, Hq, D], lse [Lq, Hq])`` of queries ``q`` over keys ``k``/values ``v`` in the
    accumulation dtype. A query with no allowed key here gets ``out = 0`` and ``lse = -inf``
    (it then contributes nothing when merged)."""
    import torch

    lq, hq, d = q.shape
    lk, hkv, _ = k.shape
    acc = acc_dtype(q.dtype)
    out = torch.zeros(lq, hq, d, dtype=acc, device=q.device)
    lse = torch.full((lq, hq), float("-inf"), dtype=acc, device=q.device)
    if lq == 0 or lk == 0:
        return out, lse
    rows = _rows_per_chunk(lq, lk, hq, torch.finfo(acc).bits // 8, chunk_bytes)
    k_t = k.to(acc).permute(1, 2, 0)  # [Hkv, D, Lk]
    v_h = v.to(acc).transpose(0, 1)  # [Hkv, Lk, D]
    for number, live in enumerate(_live_chunks(q_index, q_seg, k_index, k_seg, rows)):
        if not live:
            continue
        a, b = number * rows, min(lq, (number + 1) * rows)
        s = _masked_scores(_group(q[a:b].to(acc), hkv), k_t, q_index[a:b], q_seg[a:b], k_index, k_seg, scale)
        m = s.amax(-1, keepdim=True)
        # A row with no allowed key has max -inf; shifting it by 0 keeps exp() at 0, not NaN.
        m.masked_fill_(m == float("-inf"), 0.0)
        p = s.sub_(m).exp_()
        total = p.sum(-1, keepdim=True)
        o = torch.bmm(p, v_h).div_(total.clamp_min(torch.finfo(acc).tiny))
        out[a:b] = _ungroup(o, b - a)
        lse[a:b] = _ungroup(total.log_().add_(m), b - a)[..., 0]
    return out, lse


def block_backward(dout, q, k, v, lse, delta, q_index, q_seg, k_index, k_seg, scale, *,
                   chunk_bytes: int = CHUNK_BYTES):
    """``(dq [Lq, Hq, D], dk [Lk, Hkv, D], dv [Lk, Hkv, D])`` in the accumulation dtype: this
    block's share of the gradients. ``lse [Lq, Hq]`` is the log-sum-exp of the queries over all
    keys (the merged one) and ``delta [Lq, Hq]`` is ``sum(dout * out, -1)`` of the final
    output, so the block's probabilities are recomputed exactly as the full softmax had them."""
    import torch

    lq, hq, d = q.shape
    lk, hkv, _ = k.shape
    acc = acc_dtype(q.dtype)
    dq = torch.zeros(lq, hq, d, dtype=acc, device=q.device)
    dk = torch.zeros(hkv, lk, d, dtype=acc, device=q.device)
    dv = torch.zeros(hkv, lk, d, dtype=acc, device=q.device)
    if lq and lk:
        rows = _rows_per_chunk(lq, lk, hq, torch.finfo(acc).bits // 8, chunk_bytes)
        k_h = k.to(acc).transpose(0, 1)  # [Hkv, Lk, D]
        v_h = v.to(acc).transpose(0, 1)
        for number, live in enumerate(_live_chunks(q_index, q_seg, k_index, k_seg, rows)):
            if not live:
                continue
            a, b = number * rows, min(lq, (number + 1) * rows)
            qg = _group(q[a:b].to(acc), hkv)
            s = _masked_scores(qg, k_h.transpose(1, 2), q_index[a:b], q_seg[a:b], k_index, k_seg, scale)
            row_lse = _group(lse[a:b].to(acc).unsqueeze(-1), hkv)
            p = s.sub_(row_lse.masked_fill(row_lse == float("-inf"), 0.0)).exp_()
            dog = _group(dout[a:b].to(acc), hkv)
            dv.baddbmm_(p.transpose(1, 2), dog)
            dp = torch.bmm(dog, v_h.transpose(1, 2))
            ds = p.mul_(dp.sub_(_group(delta[a:b].to(acc).unsqueeze(-1), hkv))).mul_(scale)
            dq[a:b] = _ungroup(torch.bmm(ds, k_h), b - a)
            dk.baddbmm_(ds.transpose(1, 2), qg)
    return dq, dk.transpose(0, 1), dv.transpose(0, 1)


@dataclass(frozen=True)
class BlockKernel:
    """The pair of functions a ring runs per block; a fused kernel (flash attention with
    log-sum-exp output, ``flash_block``) stands in for the eager one with the same signatures.

    ``prepare(meta, rank)``, when set, is called once per ring call with every rank's
    ``[n, 2, L]`` positions and sample ids and returns a plan per source rank; ``forward`` then
    gets ``plan=`` and ``backward`` gets ``plan=`` and ``out=`` (the ring's final output, in
    q's dtype) as keywords."""

    forward: Any
    backward: Any
    prepare: Any = None


EAGER = BlockKernel(forward=block_forward, backward=block_backward)
