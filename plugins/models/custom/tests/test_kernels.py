"""The pieces other plugins build on: grouped matmul, the local dispatcher, the expert
layer (with DTensor weights as EP gives it), and the default attention kernel."""

import pytest
import torch

from prime_core.trainer.packing import Packing, allowed, cp_indices
from prime_plugin_custom.layers import sdpa_attention
from prime_plugin_custom.moe import LocalDispatcher, SparseMoE, grouped_mm, grouped_mm_loop

ATOL, RTOL = 1e-5, 1e-5


def naive_grouped_mm(x, w, counts):
    out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        out.append(torch.stack([x[start + i] @ w[e] for i in range(n)]) if n else x.new_zeros(0, w.shape[2]))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("counts", [[3, 0, 5, 0], [0, 0, 0, 7], [0, 0, 0, 0], [1, 1, 1, 1]])
def test_grouped_mm_loop_matches_per_row_reference(counts):
    counts = torch.tensor(counts)
    x = torch.randn(int(counts.sum()), 6, requires_grad=True)
    stored = torch.randn(4, 5, 6, requires_grad=True)  # [E, out, in], as nn.Linear stores it
    w = stored.transpose(1, 2)  # the [E, in, out] view grouped_mm takes: not contiguous
    out = grouped_mm_loop(x, w, counts)
    expected = naive_grouped_mm(x, w, counts)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)
    assert torch.equal(grouped_mm(x, w, counts), out), "the CPU / float32 dispatch is the loop"
    probe = torch.randn_like(out)
    grads = torch.autograd.grad((out * probe).sum(), (x, stored))
    if expected.requires_grad:
        expected_grads = torch.autograd.grad((expected * probe).sum(), (x, stored), allow_unused=True)
    else:  # no rows at all: nothing reaches the weights
        expected_grads = (torch.zeros_like(x), None)
    torch.testing.assert_close(grads[0], expected_grads[0], atol=ATOL, rtol=RTOL)
    expected_w = expected_grads[1] if expected_grads[1] is not None else torch.zeros_like(stored)
    torch.testing.assert_close(grads[1], expected_w, atol=ATOL, rtol=RTOL)
    for e, n in enumerate(counts.tolist()):
        if n == 0:
            assert torch.count_nonzero(grads[1][e]) == 0, "an expert without tokens gets a zero gradient"


def dense_moe_reference(x, idx, weight, expert_fns):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            out[t] = out[t] + weight[t, j].to(x.dtype) * expert_fns[idx[t, j]](x[t:t + 1])[0]
    return out


def test_local_dispatcher_matches_a_dense_per_token_reference():
    torch.manual_seed(0)
    tokens, hidden, experts, k = 13, 8, 5, 2
    x = torch.randn(tokens, hidden, requires_grad=True)
    idx = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)])
    idx[:, 0] = torch.where(idx[:, 0] == 4, 0, idx[:, 0])  # some expert ends up with few or no tokens
    idx[:, 1] = torch.where(idx[:, 1] == 4, 1, idx[:, 1])
    idx[:, 1] = torch.where(idx[:, 1] == idx[:, 0], (idx[:, 0] + 1) % 4, idx[:, 1])
    weight = torch.rand(tokens, k, requires_grad=True)
    scales = torch.randn(experts, hidden, requires_grad=True)
    fns = [lambda v, e=e: torch.tanh(v * scales[e]) for e in range(experts)]

    dispatcher = LocalDispatcher(experts)
    x_local, counts, handle = dispatcher.dispatch(x, idx, weight)
    assert counts.dtype == torch.int64 and counts.tolist() == torch.bincount(idx.flatten(), minlength=experts).tolist()
    assert counts[4] == 0
    expert_of_row = torch.repeat_interleave(torch.arange(experts), counts)
    assert torch.equal(expert_of_row, expert_of_row.sort().values), "grouped by expert, ascending"
    y_local = torch.cat([fns[e](rows) for e, rows in enumerate(torch.split(x_local, counts.tolist()))])
    out = dispatcher.combine(y_local, handle)
    expected = dense_moe_reference(x, idx, weight, fns)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)

    probe = torch.randn_like(out)
    grads = torch.autograd.grad((out * probe).sum(), (x, weight, scales))
    expected_grads = torch.autograd.grad((expected * probe).sum(), (x, weight, scales))
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def make_moe(shared=False, **kwargs):
    torch.manual_seed(0)
    moe = SparseMoE(hidden=16, intermediate=8, num_experts=4, top_k=2, norm_topk_prob=True,
                    shared_intermediate=12 if shared else None, **kwargs)
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0, 0.3)
    return moe


@pytest.mark.parametrize("shared", [False, True])
def test_sparse_moe_matches_a_dense_per_token_reference(shared):
    moe = make_moe(shared)
    x = torch.randn(11, 16)
    probs = torch.softmax(x @ moe.gate.weight.T, dim=-1)
    weight, idx = probs.topk(2, dim=-1)
    weight = weight / weight.sum(-1, keepdim=True)

    def expert(e):
        gate, up = moe.experts.gate_up_proj[e].chunk(2, dim=0)
        return lambda v: (torch.nn.functional.silu(v @ gate.T) * (v @ up.T)) @ moe.experts.down_proj[e].T

    expected = dense_moe_reference(x, idx, weight, [expert(e) for e in range(4)])
    if shared:
        expected = expected + torch.sigmoid(moe.shared_expert_gate(x)) * moe.shared_expert(x)
    torch.testing.assert_close(moe(x), expected, atol=ATOL, rtol=RTOL)


def test_a_rank_without_tokens_still_runs_the_layer():
    moe = make_moe(shared=True)
    x = torch.randn(0, 16, requires_grad=True)
    out = moe(x)
    assert out.shape == (0, 16)
    out.sum().backward()
    assert moe.experts.gate_up_proj.grad is not None and moe.experts.gate_up_proj.grad.abs().sum() == 0


def test_experts_cast_master_weights_to_the_input_dtype():
    moe = make_moe()
    x = torch.randn(9, 16)
    idx, weight = moe.route(x)
    x_local, counts, _ = moe.dispatcher.dispatch(x.bfloat16(), idx, weight)
    assert moe.experts.gate_up_proj.dtype == torch.float32
    assert moe.experts(x_local, counts).dtype == torch.bfloat16


def test_experts_compute_with_the_local_shard_of_dtensor_weights():
    """EP replaces the expert weights by DTensors sharded on dim 0; a one-rank mesh shows the
    layer computes with ``to_local()`` and the gradient reaches the DTensor."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        moe = make_moe()
        x = torch.randn(10, 16)
        expected = moe(x)
        mesh = init_device_mesh("cpu", (1,))
        for name in ("gate_up_proj", "down_proj"):
            param = getattr(moe.experts, name)
            setattr(moe.experts, name, torch.nn.Parameter(distribute_tensor(param.detach(), mesh, [Shard(0)])))
        out = moe(x)
        torch.testing.assert_close(out, expected)
        out.sum().backward()
        assert type(moe.experts.gate_up_proj.grad).__name__ == "DTensor"
    finally:
        dist.destroy_process_group()


def qkv(length, heads=4, kv_heads=2, dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(length, heads, dim, generator=generator),
            torch.randn(length, kv_heads, dim, generator=generator),
            torch.randn(length, kv_heads, dim, generator=generator))


def masked_reference(q, k, v, mask, scale):
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


def test_default_attention_kernel_on_a_packed_row_and_on_a_context_parallel_subset():
    lengths = [5, 9, 2]
    positions = torch.cat([torch.arange(n) for n in lengths])
    packing = Packing.from_position_ids(positions)
    q, k, v = qkv(len(positions))
    mask = allowed(packing.index, packing.segment_ids, packing.index, packing.segment_ids)
    full = sdpa_attention(q, k, v, packing, 0.3)
    torch.testing.assert_close(full, masked_reference(q, k, v, mask, 0.3), atol=ATOL, rtol=RTOL)

    # CP rank 0 of 2 holds chunks 0 and 3 of 4: a non-contiguous packing, masked from its indices.
    local = cp_indices(len(positions), 0, 2)
    sub = packing.select(local)
    assert not sub.contiguous
    out = sdpa_attention(q[local], k[local], v[local], sub, 0.3)
    sub_mask = allowed(sub.index, sub.segment_ids, sub.index, sub.segment_ids)
    torch.testing.assert_close(out, masked_reference(q[local], k[local], v[local], sub_mask, 0.3),
                               atol=ATOL, rtol=RTOL)
    # The first chunk sees only earlier tokens, all of them local: same as the whole row.
    first = len(positions) // 4
    torch.testing.assert_close(out[:first], full[:first], atol=ATOL, rtol=RTOL)
