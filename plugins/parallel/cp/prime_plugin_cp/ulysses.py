"""Ulysses (all-to-all) attention over a CP group.

One all-to-all turns this rank's tokens with every head (``[L, H, D]``) into every rank's
tokens with ``1/n`` of the heads (``[n * L, H / n, D]``); the model's own kernel (``inner``)
then runs on whole rows, and a second all-to-all gives every rank its tokens back. q, k and v
travel in one message. The gathered tokens arrive in rank order, not row order (the zigzag
split interleaves them), so they are sorted by their row index first and the inner kernel
sees an ordinary contiguous ``Packing``.

Heads: the query heads must divide evenly across the CP ranks. Key/value heads that do not
(few KV heads under GQA, MQA) are repeated, each ``n / gcd(n, Hkv)`` times, to the smallest
count that does; the repeats stay next to each other, so every query head still reads a copy
of its own key/value head. This costs ``n / gcd(n, Hkv)`` times the KV traffic.
"""

from __future__ import annotations

from math import gcd

from prime_plugin_cp.comm import all_to_all, gather_packing, rank_and_size


def kv_repeat(q_heads: int, kv_heads: int, cp: int) -> int:
    """How many times each key/value head is repeated so that ``cp`` ranks get whole heads;
    ``ValueError`` (naming ``trainer.model.cp``) when the heads cannot be split."""
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads are not a multiple of the {kv_heads} key/value heads")
    if q_heads % cp:
        raise ValueError(
            f"trainer.model.cp = {cp} with cp_style = 'ulysses' splits the attention heads across the CP ranks, "
            f"but the model has {q_heads} query heads ({kv_heads} key/value heads), not a multiple of {cp}; "
            f"use a cp that divides {q_heads}, or cp_style = 'ring'")
    return cp // gcd(cp, kv_heads)


def ulysses_attention(q, k, v, packing, scale, group, inner):
    """This rank's attention output ``[L, Hq, D]`` computed by ``inner(q, k, v, packing, scale)``
    on whole rows with ``Hq / n`` heads per rank. Collective: every rank of ``group`` calls it
    with the same number of tokens."""
    import torch

    _, size = rank_and_size(group)
    length, q_heads, dim = q.shape
    repeat = kv_repeat(q_heads, k.shape[1], size)
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    hq, hkv = q_heads // size, k.shape[1] // size
    order, restore, whole = whole_row(packing, group)

    # [L, n, heads of rank j, D] -> slice j goes to rank j.
    mixed = torch.cat([q.reshape(length, size, hq, dim), k.reshape(length, size, hkv, dim),
                       v.reshape(length, size, hkv, dim)], dim=2)
    rows = all_to_all(mixed.transpose(0, 1), group).reshape(size * length, hq + 2 * hkv, dim)
    rows = rows.index_select(0, order)
    q_rows, k_rows, v_rows = rows.split([hq, hkv, hkv], dim=1)
    out = inner(q_rows, k_rows, v_rows, whole, scale)
    out = out.index_select(0, restore).reshape(size, length, hq, dim)
    return all_to_all(out, group).transpose(0, 1).reshape(length, q_heads, dim)


def whole_row(packing, group):
    """``(order, restore, whole)``: where the gathered tokens go to stand in row order, the way
    back, and the whole row's ``Packing``. The same for every layer, so they are made once per
    packing (one all-gather a step, not a layer) and kept in ``packing.cache``; the inner
    kernel's own cache on ``whole`` then lasts the step too."""
    import torch

    from prime_core.trainer.packing import Packing

    key = ("cp_ulysses", group)
    if key not in packing.cache:
        meta = gather_packing(packing.index, packing.segment_ids, group)  # [n, 2, L]
        order = torch.argsort(meta[:, 0].reshape(-1), stable=True)
        total = order.numel()
        whole = Packing(segment_ids=meta[:, 1].reshape(-1).index_select(0, order),
                        index=torch.arange(total, device=order.device), length=total, starts=packing.starts)
        packing.cache[key] = (order, torch.argsort(order), whole)
    return packing.cache[key]
