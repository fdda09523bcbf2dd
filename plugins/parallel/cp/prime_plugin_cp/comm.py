"""The few collectives both CP styles use, written against any process group (gloo or NCCL)."""

from __future__ import annotations

import functools


def rank_and_size(group) -> tuple[int, int]:
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group)


def gather_packing(index, segment_ids, group):
    """``[n, 2, L]`` int64: every CP rank's ``(index, segment_ids)``, in group-rank order.

    Every rank of a CP group holds the same number of tokens (``cp_indices`` splits a padded
    row evenly), so a plain all-gather suffices."""
    import torch
    import torch.distributed as dist

    mine = torch.stack([index.reshape(-1), segment_ids.reshape(-1)]).to(torch.int64).contiguous()
    n = dist.get_world_size(group)
    parts = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(parts, mine, group=group)
    return torch.stack(parts)


def shift(send, recv, group, *, tag: int = 0):
    """Start sending ``send`` to the next rank of the ring and receiving the previous rank's
    into ``recv``; returns the requests to ``wait`` on."""
    import torch.distributed as dist

    rank, size = rank_and_size(group)
    ops = [dist.P2POp(dist.isend, send, dist.get_global_rank(group, (rank + 1) % size), group, tag),
           dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, (rank - 1) % size), group, tag)]
    return dist.batch_isend_irecv(ops)


def wait(requests) -> None:
    for request in requests:
        request.wait()


def all_to_all(x, group):
    """Differentiable equal-split all-to-all along dim 0 (``x [n, ...]``: slice ``j`` goes to
    rank ``j``; the result's slice ``j`` came from rank ``j``)."""
    return _all_to_all_function().apply(x, group)


# Built on first use: importing the plugin must not import torch.
@functools.cache
def _all_to_all_function():
    import torch

    class AllToAll(torch.autograd.Function):
        # The adjoint of an equal-split all-to-all is the same exchange, so the backward
        # pass sends each gradient slice back to where its input slice came from.
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return _exchange(x, group)

        @staticmethod
        def backward(ctx, grad):
            return _exchange(grad, ctx.group), None

    return AllToAll


def _exchange(x, group):
    import torch
    import torch.distributed as dist

    x = x.contiguous()
    if dist.get_world_size(group) == 1:
        return x.clone()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out
