"""A stand-in for ``deep_ep`` on CPUs (gloo), written from DeepEP's documented ``Buffer``
semantics, to test the dispatcher's own logic (expansion to copies, grouping, weighting,
chunking, empty inputs, autograd wiring) where DeepEP cannot run. It is no evidence that the
real kernels behave the same; ``test_deepep_contract_on_gpus`` is.

What it reproduces: ``get_dispatch_layout``; ``dispatch`` sends each token once to every rank
holding one of its experts (rows by source rank, then token order), with top-k indices made
local (``-1`` for other ranks' experts, whose weights are junk) and the per-local-expert
counts as a Python list; a cached ``dispatch(x, handle=...)`` resends with the same layout;
``combine`` sums the rows (and top-k weights) of each token over the ranks, without weights.
Like DeepEP it refuses non-bf16 tokens and empty inputs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

topk_idx_t = torch.int64
calls = {"buffers": 0, "dispatch": 0, "combine": 0}


class Config:
    def __init__(self, num_sms, *chunks):
        self.num_sms = num_sms

    def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
        return hidden_bytes * 1024

    def get_rdma_buffer_size_hint(self, hidden_bytes, num_ranks):
        return 0


class _Event:
    def current_stream_wait(self):
        pass


def _exchange(rows, send_splits, recv_splits, group):
    out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), recv_splits, send_splits, group=group)
    return out


class Buffer:
    num_sms = 20

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, **kwargs):
        self.group, self.rank, self.group_size = group, group.rank(), group.size()
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        calls["buffers"] += 1

    @staticmethod
    def set_num_sms(new_num_sms):
        assert new_num_sms % 2 == 0, "The SM count must be even"
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks):
        assert num_ranks in (2, 4, 8, 16, 24, 32, 64, 128), f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks):
        assert num_ranks in (2, 4, 8, 16, 24, 32, 64, 128), f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        assert topk_idx.dtype == topk_idx_t and topk_idx.numel() > 0, "topk_idx_ptr != 0"
        per_rank = num_experts // self.group_size
        dest = torch.where(topk_idx >= 0, topk_idx // per_rank, -1)
        in_rank = torch.stack([(dest == r).any(1) for r in range(self.group_size)], dim=1)
        per_expert = torch.bincount(topk_idx[topk_idx >= 0], minlength=num_experts).int()
        return in_rank.sum(0).int(), None, per_expert, in_rank, _Event()

    def _layout(self, in_rank):
        order = torch.cat([in_rank[:, r].nonzero().flatten() for r in range(self.group_size)])
        send = in_rank.sum(0).long()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        return order, send.tolist(), recv.tolist()

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment=1, num_worst_tokens=0, config=None, previous_event=None, async_finish=False,
                 allocate_on_comm_stream=False):
        assert x.dtype == torch.bfloat16 and x.shape[0] > 0 and x.is_contiguous(), (x.dtype, x.shape)
        calls["dispatch"] += 1
        if handle is not None:
            assert topk_idx is None and topk_weights is None
            order, send, recv, _ = handle
            return _exchange(x.float()[order], send, recv, self.group).to(x.dtype), None, None, None, None, _Event()
        assert topk_weights.dtype == torch.float32 and num_tokens_per_rank is not None
        order, send, recv = self._layout(is_token_in_rank)
        recv_x = _exchange(x.float()[order], send, recv, self.group).to(x.dtype)
        num_experts = num_tokens_per_expert.numel()
        per_rank = num_experts // self.group_size
        dest_of_row = torch.repeat_interleave(torch.arange(self.group_size), torch.tensor(send))
        idx = topk_idx[order]
        local = torch.where(idx // per_rank == dest_of_row[:, None], idx - dest_of_row[:, None] * per_rank, -1)
        weights = torch.where(local >= 0, topk_weights[order], 7.0)  # junk where the expert is elsewhere
        recv_idx = _exchange(local, send, recv, self.group)
        recv_weights = _exchange(weights, send, recv, self.group)
        counts = [int((recv_idx == e).sum()) for e in range(per_rank)]
        return recv_x, recv_idx, recv_weights, counts, (order, send, recv, x.shape[0]), _Event()

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish=False, allocate_on_comm_stream=False):
        assert x.dtype == torch.bfloat16 and x.is_contiguous()
        calls["combine"] += 1
        order, send, recv, tokens = handle
        back = _exchange(x.float(), recv, send, self.group)
        combined = torch.zeros(tokens, x.shape[1]).index_add_(0, order, back).to(torch.bfloat16)
        weights = None
        if topk_weights is not None:
            back = _exchange(topk_weights.float(), recv, send, self.group)
            weights = torch.zeros(tokens, topk_weights.shape[1]).index_add_(0, order, back)
        return combined, weights, _Event()
