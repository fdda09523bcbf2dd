"""Ring attention over a CP group for packed rows split in any way (``cp_indices`` zigzag).

Forward: every rank keeps its queries; the keys and values (``[2, L, Hkv, D]``, never the
GQA-repeated heads) pass once around the ring. Each rank runs the block kernel on every key
block it sees and merges the per-block ``(out, lse)`` with an online log-sum-exp. The next
block's transfer is started before the current block is computed, so the two overlap.

Backward: recomputes per block from the saved q, k, v, out and lse (no per-block scores are
kept across the ring). The keys/values go around again, each travelling with an accumulator
of its dK/dV that every rank adds its share to; one last shift brings every accumulator home.

Each rank learns every block's ``index``/``segment_ids`` with one all-gather per call instead
of sending them along with each block: the ring still delivers block ``(rank - step) % n`` at
step ``step``, and knowing all of them up front lets a rank skip the blocks its queries can
never attend (all keys later, or other samples) with one host sync.
"""

from __future__ import annotations

from prime_plugin_cp.block import EAGER, acc_dtype
from prime_plugin_cp.comm import gather_packing, rank_and_size, shift, wait

_KV_TAG, _GRAD_TAG = 0, 1


def ring_attention(q, k, v, packing, scale, group, *, kernel=EAGER):
    """Attention of this rank's queries over the keys of every rank of ``group``.

    q ``[L, Hq, D]``, k/v ``[L, Hkv, D]`` (this rank's tokens), ``packing`` their
    ``prime_core.trainer.packing.Packing``; returns ``[L, Hq, D]`` in q's dtype. Collective:
    every rank of ``group`` calls it with the same number of tokens. ``kernel`` is the
    per-block ``BlockKernel`` (the eager one by default)."""
    return _function().apply(q, k, v, packing.index.reshape(-1), packing.segment_ids.reshape(-1),
                             float(scale), group, kernel)


def live_blocks(meta, q_index, q_seg) -> list[bool]:
    """Per source rank: may any of its keys be attended by these queries (``meta [n, 2, L]``)?"""
    k_index, k_seg = meta[:, 0], meta[:, 1]
    live = ((k_index.amin(1) <= q_index.max()) & (k_seg.amin(1) <= q_seg.max()) & (k_seg.amax(1) >= q_seg.min()))
    return live.tolist()


def merge(out, lse, block_out, block_lse) -> None:
    """Fold one block's normalised ``(out, lse)`` into the running ones, in place."""
    import torch

    new = torch.logaddexp(lse, block_lse)
    # -inf only when neither has seen an allowed key; subtracting 0 then keeps both weights 0.
    base = new.masked_fill(new == float("-inf"), 0.0)
    out.mul_(torch.exp(lse - base).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - base).unsqueeze(-1))
    lse.copy_(new)


def forward(q, k, v, q_index, q_seg, scale, group, kernel):
    """``(out [L, Hq, D] in the accumulation dtype, lse [L, Hq], meta, live)``."""
    import torch

    from prime_core.trainer.packing import Packing

    rank, size = rank_and_size(group)
    meta = gather_packing(Packing(segment_ids=q_seg, index=q_index, length=0), group)
    live = live_blocks(meta, q_index, q_seg)
    acc = acc_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=acc, device=q.device)
    kv = torch.stack([k, v])
    for step in range(size):
        source = (rank - step) % size
        pending, incoming = [], None
        if step < size - 1:
            incoming = torch.empty_like(kv)
            pending = shift(kv, incoming, group, tag=_KV_TAG)
        if live[source]:
            block_out, block_lse = kernel.forward(q, kv[0], kv[1], q_index, q_seg, meta[source, 0],
                                                  meta[source, 1], scale)
            merge(out, lse, block_out, block_lse)
        wait(pending)
        kv = incoming
    return out, lse, meta, live


def backward(dout, q, k, v, out, lse, q_index, q_seg, meta, live, scale, group, kernel):
    """``(dq, dk, dv)`` in the accumulation dtype."""
    import torch

    rank, size = rank_and_size(group)
    acc = acc_dtype(q.dtype)
    delta = (dout.to(acc) * out.to(acc)).sum(-1)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = torch.stack([k, v])
    dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
    for step in range(size):
        source = (rank - step) % size
        pending, incoming = [], None
        if step < size - 1:
            incoming = torch.empty_like(kv)
            pending = shift(kv, incoming, group, tag=_KV_TAG)
        if live[source]:
            block_dq, block_dk, block_dv = kernel.backward(dout, q, kv[0], kv[1], lse, delta, q_index, q_seg,
                                                           meta[source, 0], meta[source, 1], scale)
            dq += block_dq
            dkv[0] += block_dk
            dkv[1] += block_dv
        if size > 1:
            # After the last step this shift is the one that brings each accumulator home.
            arriving = torch.empty_like(dkv)
            pending = [*pending, *shift(dkv, arriving, group, tag=_GRAD_TAG)]
            wait(pending)
            dkv = arriving
        kv = incoming
    return dq, dkv[0], dkv[1]


_FUNCTION = None


def _function():
    global _FUNCTION
    if _FUNCTION is None:
        import torch

        class RingAttention(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q, k, v, q_index, q_seg, scale, group, kernel):
                out, lse, meta, live = forward(q, k, v, q_index, q_seg, scale, group, kernel)
                out = out.to(q.dtype)
                ctx.save_for_backward(q, k, v, out, lse, q_index, q_seg, meta)
                ctx.live, ctx.scale, ctx.group, ctx.kernel = live, scale, group, kernel
                return out

            @staticmethod
            def backward(ctx, dout):
                q, k, v, out, lse, q_index, q_seg, meta = ctx.saved_tensors
                dq, dk, dv = backward(dout.contiguous(), q, k, v, out, lse, q_index, q_seg, meta, ctx.live,
                                      ctx.scale, ctx.group, ctx.kernel)
                return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None

        _FUNCTION = RingAttention
    return _FUNCTION
