"""The ``deepep`` EP backend: DeepEP's normal (high-throughput) kernels, intranode over
NVLink and internode over RDMA, behind the ``EPBackend`` dispatch/combine contract.

Written against ``deep_ep.Buffer`` (DeepEP's V1 API, kept as the legacy buffer in later
releases): ``get_dispatch_layout``, ``dispatch`` and ``combine``; ``combine`` is the backward
of ``dispatch`` and a cached ``dispatch(handle=...)`` the backward of ``combine``, as DeepEP's
training example does. Not run in this repository's CI (no GPU, no DeepEP): the contract tests
of ``prime_plugin_ep.contract`` are the check to run on a GPU node.

How it differs from the ``torch`` backend, because of how DeepEP moves tokens:

- DeepEP sends each token once per destination rank, with its top-k indices rewritten to
  that rank's local experts (``-1`` for experts elsewhere) and its top-k weights. The
  dispatcher expands those rows into one row per (token, local expert) copy, grouped by local
  expert.
- DeepEP's combine sums one row per (token, rank) without weights, so ``combine`` weights
  each copy and sums the copies of a row on the expert's rank first; the router's gradient
  then comes back through the dispatch's backward (DeepEP combines the weights' gradients).
- DeepEP carries bfloat16 tokens: other dtypes are cast for the exchange and back.
- A chunk of zero tokens is sent as one dummy token routed nowhere (DeepEP asserts on empty
  inputs), so that every rank still takes part in every collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class _Chunk:
    """One DeepEP dispatch: its handle and what it received."""

    buffer: Any
    dispatch_config: Any
    combine_config: Any
    handle: Any = None
    recv_idx: Any = None
    counts: list[int] = field(default_factory=list)
    tokens: int = 0
    """Real tokens sent (a padded empty chunk sends one dummy token, dropped on combine)."""


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weight, topk_idx, num_experts: int, chunk: _Chunk):
        buffer = chunk.buffer
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
        recv_x, recv_idx, recv_weight, counts, handle, _ = buffer.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weight, num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            config=chunk.dispatch_config)
        chunk.handle, chunk.recv_idx, chunk.counts = handle, recv_idx, list(counts)
        ctx.chunk = chunk
        return recv_x, recv_weight

    @staticmethod
    def backward(ctx, grad_x, grad_weight):
        chunk = ctx.chunk
        grad_x, grad_weight, _ = chunk.buffer.combine(grad_x.contiguous(), chunk.handle,
                                                      topk_weights=grad_weight.float().contiguous(),
                                                      config=chunk.combine_config)
        return grad_x, grad_weight, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, chunk: _Chunk):
        combined, _, _ = chunk.buffer.combine(rows.contiguous(), chunk.handle, config=chunk.combine_config)
        ctx.chunk = chunk
        return combined

    @staticmethod
    def backward(ctx, grad):
        chunk = ctx.chunk
        grad_rows, *_ = chunk.buffer.dispatch(grad.contiguous(), handle=chunk.handle, config=chunk.dispatch_config)
        return grad_rows, None


@dataclass
class Handle:
    chunks: list[_Chunk]
    received: list[int]
    """Rows each chunk received (one per source token and this rank)."""
    copy: Any
    """Flat ``[rows * k]`` positions of the (row, top-k slot) copies, grouped by local expert."""
    recv_weight: Any
    top_k: int
    dtype: Any


class DeepEPDispatcher:
    """Dispatch/combine with a ``deep_ep.Buffer`` over ``group`` (created on first use, when
    the hidden size is known, and grown if a larger one comes)."""

    def __init__(self, group, *, num_experts: int, config=None) -> None:
        import deep_ep

        self.deep_ep = deep_ep
        self.group = group
        self.size = dist.get_world_size(group)
        if num_experts % self.size:
            raise ValueError(f"{num_experts} experts cannot be split evenly over an EP group of {self.size} ranks")
        self.num_experts = num_experts
        self.local_experts = num_experts // self.size
        num_sms = getattr(config, "deepep_num_sms", None)
        if num_sms:
            deep_ep.Buffer.set_num_sms(num_sms)  # process-wide in DeepEP: every buffer uses it
        try:
            self.dispatch_config = deep_ep.Buffer.get_dispatch_config(self.size)
            self.combine_config = deep_ep.Buffer.get_combine_config(self.size)
        except AssertionError as exc:
            raise ValueError(f"DeepEP has no kernel configuration for EP groups of {self.size} ranks ({exc}); "
                             "choose another trainer.model.ep or ep_comm_backend = 'torch'") from None
        self.chunk_size = getattr(config, "deepep_token_chunk_size", None)
        self.idx_dtype = getattr(deep_ep, "topk_idx_t", torch.int64)
        self.buffer = None
        self.hidden_bytes = 0

    def _buffer(self, hidden: int):
        hidden_bytes = hidden * torch.bfloat16.itemsize
        if self.buffer is None or hidden_bytes > self.hidden_bytes:
            configs = (self.dispatch_config, self.combine_config)
            nvl = max(c.get_nvl_buffer_size_hint(hidden_bytes, self.size) for c in configs)
            rdma = max(c.get_rdma_buffer_size_hint(hidden_bytes, self.size) for c in configs)
            self.buffer = self.deep_ep.Buffer(self.group, nvl, rdma)
            self.hidden_bytes = hidden_bytes
        return self.buffer

    def _bounds(self, tokens: int, device) -> list[tuple[int, int]]:
        if not self.chunk_size:
            return [(0, tokens)]
        # Every rank must run as many dispatches as the rank with the most tokens.
        most = torch.tensor([tokens], device=device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.group)
        count = max(1, -(-int(most.item()) // self.chunk_size))
        return [(min(i * self.chunk_size, tokens), min((i + 1) * self.chunk_size, tokens)) for i in range(count)]

    def dispatch(self, x, topk_idx, topk_weight):
        tokens, top_k = topk_idx.shape
        buffer = self._buffer(x.shape[1])
        x16 = x.to(torch.bfloat16)
        weight = topk_weight.float()
        idx = topk_idx.to(self.idx_dtype)
        chunks, recv_x, recv_weight = [], [], []
        for start, end in self._bounds(tokens, x.device):
            chunk = _Chunk(buffer, self.dispatch_config, self.combine_config, tokens=end - start)
            part_x, part_w, part_idx = x16[start:end], weight[start:end], idx[start:end]
            if end == start:  # sliced from the inputs so that autograd still reaches this dispatch
                part_x = torch.cat([part_x, x16.new_zeros(1, x.shape[1])])
                part_w = torch.cat([part_w, weight.new_zeros(1, top_k)])
                part_idx = torch.cat([part_idx, idx.new_full((1, top_k), -1)])
            got_x, got_w = _Dispatch.apply(part_x.contiguous(), part_w.contiguous(), part_idx.contiguous(),
                                           self.num_experts, chunk)
            chunks.append(chunk)
            recv_x.append(got_x)
            recv_weight.append(got_w)
        recv_x, recv_weight = torch.cat(recv_x), torch.cat(recv_weight)
        recv_idx = torch.cat([chunk.recv_idx for chunk in chunks])
        counts = [sum(per_expert) for per_expert in zip(*(chunk.counts for chunk in chunks), strict=True)]
        # Sort the (row, slot) copies by local expert; slots of other ranks' experts sort last.
        key = torch.where(recv_idx >= 0, recv_idx, self.local_experts).reshape(-1)
        copy = torch.sort(key, stable=True).indices[:sum(counts)]
        x_local = recv_x.index_select(0, copy // top_k).to(x.dtype)
        handle = Handle(chunks, [chunk.recv_idx.shape[0] for chunk in chunks], copy, recv_weight, top_k, x.dtype)
        return x_local, torch.tensor(counts, dtype=torch.int64, device=x.device), handle

    def combine(self, y_local, handle: Handle):
        weight = handle.recv_weight.reshape(-1).index_select(0, handle.copy).to(y_local.dtype)
        rows = y_local.new_zeros(sum(handle.received), y_local.shape[1])
        rows = rows.index_add(0, handle.copy // handle.top_k, y_local * weight.unsqueeze(1)).to(torch.bfloat16)
        outs = [_Combine.apply(part, chunk)[:chunk.tokens]
                for part, chunk in zip(rows.split(handle.received), handle.chunks, strict=True)]
        return torch.cat(outs).to(handle.dtype)


def make(group, *, num_experts: int, config=None) -> DeepEPDispatcher:
    """``EPBackend.make`` of the ``deepep`` backend."""
    return DeepEPDispatcher(group, num_experts=num_experts, config=config)
