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

import functools

from prime_plugin_cp.block import EAGER, acc_dtype, any_allowed
from prime_plugin_cp.comm import gather_packing, rank_and_size, shift, wait

_KV_TAG, _GRAD_TAG = 0, 1


def ring_attention(q, k, v, packing, scale, group, *, kernel=EAGER):
    """Attention of this rank's queries over the keys of every rank of ``group``.

    q ``[L, Hq, D]``, k/v ``[L, Hkv, D]`` (this rank's tokens), ``packing`` their
    ``prime_core.trainer.packing.Packing``; returns ``[L, Hq, D]`` in q's dtype. Collective:
    every rank of ``group`` calls it with the same number of tokens. ``kernel`` is the
    per-block ``BlockKernel`` (the eager one by default)."""
    if q.shape[1] % k.shape[1] or k.shape != v.shape or q.shape[0] != k.shape[0]:
        raise ValueError(f"ring attention needs q [L, Hq, D] and k, v [L, Hkv, D] with Hq a multiple of Hkv; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    q_index, q_seg = packing.index.reshape(-1), packing.segment_ids.reshape(-1)
    return _function().apply(q, k, v, q_index, q_seg, float(scale), group, kernel,
                             layout(packing, q_index, q_seg, group, kernel))


def layout(packing, q_index, q_seg, group, kernel):
    """``(meta, live, plans)`` of this packing on ``group``: every rank's positions, the blocks
    these queries may attend, and the kernel's plans. The same for every layer, so they are
    made once per packing (one all-gather and one host sync per step, not per layer) and kept
    in ``packing.cache``."""
    key = ("cp_ring", group, kernel)
    if key not in packing.cache:
        rank, _ = rank_and_size(group)
        meta = gather_packing(q_index, q_seg, group)
        plans = kernel.prepare(meta, rank) if kernel.prepare is not None else None
        packing.cache[key] = (meta, live_blocks(meta, q_index, q_seg), plans)
    return packing.cache[key]


def live_blocks(meta, q_index, q_seg) -> list[bool]:
    """Per source rank: may any of its keys be attended by these queries (``meta [n, 2, L]``)?"""
    return any_allowed(q_index[None], q_seg[None], meta[:, 0], meta[:, 1])[0].tolist()


def merge(out, lse, block_out, block_lse) -> None:
    """Fold one block's normalised ``(out, lse)`` into the running ones, in place."""
    import torch

    new = torch.logaddexp(lse, block_lse)
    # -inf only when neither has seen an allowed key; subtracting 0 then keeps both weights 0.
    base = new.masked_fill(new == float("-inf"), 0.0)
    out.mul_(torch.exp(lse - base).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - base).unsqueeze(-1))
    lse.copy_(new)


def _pass_on(kv, step: int, size: int, group):
    """Start sending ``kv`` to the next rank (and receiving the previous rank's) unless this is
    the last ring step: ``(pending requests, incoming buffer or None)``."""
    import torch

    if step == size - 1:
        return [], None
    incoming = torch.empty_like(kv)
    return shift(kv, incoming, group, tag=_KV_TAG), incoming


def ring_forward(q, kv, q_index, q_seg, scale, group, kernel, meta, live, plans):
    """``(out [L, Hq, D], lse [L, Hq])`` in the accumulation dtype for this rank's queries and
    keys/values ``kv [2, L, Hkv, D]``, given the ring's ``layout``."""
    import torch

    rank, size = rank_and_size(group)
    acc = acc_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=acc, device=q.device)
    for step in range(size):
        source = (rank - step) % size
        pending, incoming = _pass_on(kv, step, size, group)
        if live[source]:
            extra = {"plan": plans[source]} if plans is not None else {}
            block_out, block_lse = kernel.forward(q, kv[0], kv[1], q_index, q_seg, meta[source, 0],
                                                  meta[source, 1], scale, **extra)
            merge(out, lse, block_out, block_lse)
        wait(pending)
        kv = incoming
    return out, lse


def ring_backward(dout, q, kv, out, lse, q_index, q_seg, meta, live, scale, group, kernel, plans=None):
    """``(dq, dk, dv)`` in the accumulation dtype."""
    import torch

    rank, size = rank_and_size(group)
    acc = acc_dtype(q.dtype)
    delta = (dout.to(acc) * out.to(acc)).sum(-1)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
    for step in range(size):
        source = (rank - step) % size
        pending, incoming = _pass_on(kv, step, size, group)
        if live[source]:
            extra = {"plan": plans[source], "out": out} if plans is not None else {}
            block_dq, block_dk, block_dv = kernel.backward(dout, q, kv[0], kv[1], lse, delta, q_index, q_seg,
                                                           meta[source, 0], meta[source, 1], scale, **extra)
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


# Built on first use: importing the plugin must not import torch.
@functools.cache
def _function():
    import torch

    class RingAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, q_index, q_seg, scale, group, kernel, layout):
            kv = torch.stack([k, v])  # one message per ring step
            meta, live, plans = layout
            out, lse = ring_forward(q, kv, q_index, q_seg, scale, group, kernel, meta, live, plans)
            out = out.to(q.dtype)
            ctx.save_for_backward(q, kv, out, lse, q_index, q_seg, meta)
            ctx.live, ctx.scale, ctx.group, ctx.kernel, ctx.plans = live, scale, group, kernel, plans
            ctx.kv_dtypes = (k.dtype, v.dtype)
            return out

        @staticmethod
        def backward(ctx, dout):
            q, kv, out, lse, q_index, q_seg, meta = ctx.saved_tensors
            dq, dk, dv = ring_backward(dout.contiguous(), q, kv, out, lse, q_index, q_seg, meta, ctx.live,
                                       ctx.scale, ctx.group, ctx.kernel, ctx.plans)
            k_dtype, v_dtype = ctx.kv_dtypes
            return dq.to(q.dtype), dk.to(k_dtype), dv.to(v_dtype), None, None, None, None, None, None

    return RingAttention
