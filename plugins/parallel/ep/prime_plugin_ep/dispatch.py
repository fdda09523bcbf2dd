"""The ``torch`` EP backend: token dispatch/combine with ``all_to_all_single`` over the EP group.

Works on any process-group backend that implements ``all_to_all_single`` with split sizes
(NCCL, gloo). The contract is ``prime_core.specs.EPBackend``'s docstring.

One host synchronisation per dispatch: the split sizes of the token exchange must be Python
integers, so the per-peer counts come to the host once, after the count exchange. Everything
else (counting, sorting, regrouping) stays on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with split sizes whose backward is the reverse exchange.

    Ours rather than ``torch.distributed.nn.functional.all_to_all_single``, which torch 2.13
    deprecates (its replacement lives in a private module)."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


def _exchange(x, out_splits, in_splits, group):
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def _inverse(permutation):
    inverse = torch.empty_like(permutation)
    inverse[permutation] = torch.arange(permutation.numel(), device=permutation.device)
    return inverse


@dataclass
class Handle:
    """What ``combine`` needs to undo a ``dispatch``."""

    order: Any
    """Token copies (flattened ``[T * k]``) sorted by global expert: the send order."""
    regroup: Any
    """Received rows (by source rank, then expert) sorted by local expert; ``None`` alone."""
    send_splits: list[int] | None
    recv_splits: list[int] | None
    topk_weight: Any
    tokens: int
    top_k: int


class TorchDispatcher:
    """Dispatch/combine over ``group`` (``None`` or a group of one rank: local, no communication)."""

    def __init__(self, group, *, num_experts: int) -> None:
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        if num_experts % self.size:
            raise ValueError(f"{num_experts} experts cannot be split evenly over an EP group of {self.size} ranks")
        self.num_experts = num_experts
        self.local_experts = num_experts // self.size

    def dispatch(self, x, topk_idx, topk_weight):
        tokens, top_k = topk_idx.shape
        flat = topk_idx.reshape(-1)
        order = torch.sort(flat, stable=True).indices
        # scatter_add instead of bincount: bincount sizes its output from max() on the host.
        send_counts = torch.zeros(self.num_experts, dtype=torch.int64, device=flat.device)
        send_counts.scatter_add_(0, flat, torch.ones_like(flat))
        rows = x.index_select(0, order // top_k)
        if self.size == 1:
            return rows, send_counts, Handle(order, None, None, None, topk_weight, tokens, top_k)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        per_peer = torch.stack([send_counts.view(self.size, -1).sum(1), recv_counts.view(self.size, -1).sum(1)])
        send_splits, recv_splits = per_peer.tolist()
        received = _AllToAll.apply(rows, recv_splits, send_splits, self.group)
        # Received rows come by source rank, then by local expert within each source.
        expert_of_row = torch.arange(self.local_experts, device=flat.device).repeat(self.size)
        expert_of_row = expert_of_row.repeat_interleave(recv_counts, output_size=received.shape[0])
        regroup = torch.sort(expert_of_row, stable=True).indices
        counts = recv_counts.view(self.size, self.local_experts).sum(0)
        handle = Handle(order, regroup, send_splits, recv_splits, topk_weight, tokens, top_k)
        return received.index_select(0, regroup), counts, handle

    def combine(self, y_local, handle: Handle):
        if handle.regroup is None:
            by_expert = y_local
        else:
            by_source = y_local.index_select(0, _inverse(handle.regroup))
            by_expert = _AllToAll.apply(by_source, handle.send_splits, handle.recv_splits, self.group)
        copies = by_expert.index_select(0, _inverse(handle.order))
        copies = copies.view(handle.tokens, handle.top_k, copies.shape[-1])
        # Weighting here, on the token's home rank, keeps the router's gradient local. The
        # weights take the activations' dtype (bf16 matmuls still accumulate in fp32).
        weights = handle.topk_weight.to(copies.dtype).unsqueeze(1)
        return torch.bmm(weights, copies).squeeze(1)


def make(group, *, num_experts: int, config=None) -> TorchDispatcher:
    """``EPBackend.make`` of the ``torch`` backend (``config`` is not used)."""
    return TorchDispatcher(group, num_experts=num_experts)
