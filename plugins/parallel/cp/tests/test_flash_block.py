"""The ring's flash block kernel (``prime_plugin_cp.flash_block``): how it splits each block
into flash calls, and, with flash's varlen contract emulated by the eager kernel (below), that
the ring built on it matches dense attention in outputs and q/k/v gradients on packed rows of
uneven samples under the zigzag split (cp 2 and 4, GQA and MQA). On a GPU (``gpu`` marker) the
same ring runs torch's real flash kernel in bf16."""

from __future__ import annotations

import math

import pytest
import torch

from prime_core.trainer.packing import Packing, cp_indices, pad_to
from prime_plugin_cp.block import EAGER, block_backward, block_forward
from prime_plugin_cp.flash_block import FLASH, Part, _overlapping, make_kernel, plan_block, runs_of
from prime_plugin_cp.reference import dense_attention
from prime_plugin_cp.ring import merge

UNEVEN = (37, 5, 83)
D = 16


# Flash attention's varlen contract, emulated with the eager block kernel (any device and
# dtype), in place of aten._flash_attention_forward / _backward: each sequence of a part
# attends its own keys, causally with the mask aligned to the bottom right (flash's rule) or
# all of them; the forward returns (out in q's dtype, lse [H, n]); the backward recomputes the
# probabilities from the given final out and lse.
def _positions(part, device):
    q_index, q_seg, k_index, k_seg = [], [], [], []
    for number, (qa, qb, ka, kb) in enumerate(zip(part.cu_q, part.cu_q[1:], part.cu_k, part.cu_k[1:], strict=False)):
        nq, nk = qb - qa, kb - ka
        k_index.append(torch.arange(nk))
        q_index.append(torch.arange(nq) + (nk - nq) if part.causal else torch.full((nq,), nk))
        q_seg.append(torch.full((nq,), number))
        k_seg.append(torch.full((nk,), number))
    return [torch.cat(t).to(device) for t in (q_index, q_seg, k_index, k_seg)]


class EagerFlash:
    @staticmethod
    def forward(q, k, v, part, scale):
        out, lse = block_forward(q, k, v, *_positions(part, q.device), scale)
        return out.to(q.dtype), lse.t().contiguous()  # float32 for bf16 inputs, as flash returns it

    @staticmethod
    def backward(dout, q, k, v, out, lse, part, scale):
        delta = (dout.double() * out.double()).sum(-1).to(torch.promote_types(q.dtype, torch.float32))
        dq, dk, dv = block_backward(dout, q, k, v, lse.t(), delta, *_positions(part, q.device), scale)
        return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)



EMULATED = make_kernel(EagerFlash)


def _row(lengths, cp, device="cpu") -> Packing:
    positions = [torch.arange(n) for n in lengths]
    filler = pad_to(sum(lengths), 2 * cp) - sum(lengths)
    if filler:
        positions.append(torch.arange(filler))
    return Packing.from_position_ids(torch.cat(positions).to(device))


def ring_in_one_process(q, k, v, dout, row, cp, kernel, scale):
    """The ring's arithmetic for every CP rank in one process (what ``ring_forward`` and
    ``ring_backward`` do, without the sends): outputs and q/k/v gradients of the whole row."""
    locals_ = [cp_indices(row.length, r, cp, device=q.device) for r in range(cp)]
    meta = torch.stack([torch.stack([row.index[i], row.segment_ids[i]]) for i in locals_]).to(torch.int64)
    out, dq = torch.zeros_like(q), torch.zeros_like(q, dtype=torch.float64)
    dk, dv = (torch.zeros_like(k, dtype=torch.float64) for _ in range(2))
    acc = torch.promote_types(q.dtype, torch.float32)
    for rank, mine in enumerate(locals_):
        plans = kernel.prepare(meta, rank) if kernel.prepare is not None else None
        qr, qi, qs = q[mine], meta[rank, 0], meta[rank, 1]
        o = torch.zeros(qr.shape, dtype=acc, device=q.device)
        lse = torch.full(qr.shape[:2], float("-inf"), dtype=acc, device=q.device)
        for source, theirs in enumerate(locals_):
            extra = {"plan": plans[source]} if plans is not None else {}
            merge(o, lse, *kernel.forward(qr, k[theirs], v[theirs], qi, qs, meta[source, 0], meta[source, 1], scale,
                                          **extra))
        final = o.to(q.dtype)
        out[mine] = final
        delta = (dout[mine].to(acc) * final.to(acc)).sum(-1)
        for source, theirs in enumerate(locals_):
            extra = {"plan": plans[source], "out": final} if plans is not None else {}
            g = kernel.backward(dout[mine], qr, k[theirs], v[theirs], lse, delta, qi, qs, meta[source, 0],
                                meta[source, 1], scale, **extra)
            dq[mine] += g[0].double()
            dk[theirs] += g[1].double()
            dv[theirs] += g[2].double()
    return out, dq, dk, dv


def _errors(kernel, cp, *, hq=4, hkv=2, dtype=torch.float64, device="cpu", lengths=UNEVEN):
    row = _row(lengths, cp, device)
    gen = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(row.length, h, D, dtype=torch.float64, generator=gen).to(device)
                     for h in (hq, hkv, hkv, hq))
    scale = 1 / math.sqrt(D)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = dense_attention(*full, row, scale)
    want.backward(dout)
    want = want.detach()
    got = ring_in_one_process(*(t.to(dtype) for t in (q, k, v, dout)), row, cp, kernel, scale)
    return {name: float((g.double() - w).abs().max())
            for name, g, w in zip(("out", "dq", "dk", "dv"), got, (want, *(t.grad for t in full)), strict=True)}


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("heads", [(4, 2), (4, 1)], ids=["gqa", "mqa"])
def test_the_flash_plan_matches_dense_attention(cp, heads):
    errors = _errors(EMULATED, cp, hq=heads[0], hkv=heads[1])
    assert max(errors.values()) < 1e-12, errors


def test_the_eager_kernel_in_the_same_harness():
    """The harness itself: the eager kernel through the same one-process ring."""
    assert max(_errors(EAGER, 2).values()) < 1e-12


def test_zigzag_blocks_become_few_flash_calls():
    """cp = 2 on one 40-token sample: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2."""
    def runs(chunks):
        return runs_of([(i * 10, c * 10, 0) for i, c in enumerate(chunks)], 20)

    r0, r1 = runs([0, 3]), runs([1, 2])
    assert [(r.start, r.end, r.index) for r in r1] == [(0, 20, 10)]  # chunks 1 and 2 are one run
    # Chunk 3's queries see chunk 0 whole and themselves causally: one causal call whose
    # sequence has chunk 0's keys in front (flash aligns the mask to the bottom right).
    assert plan_block(r0, r0) == [Part((0, 10), (0, 10), (0, 10), (0, 10), causal=True),
                                  Part((10, 20), (0, 20), (0, 10), (0, 20), causal=True)]
    assert plan_block(r0, r1) == [Part((10, 20), (0, 20), (0, 10), (0, 20), causal=False)]
    assert plan_block(r1, r0) == [Part((0, 20), (0, 10), (0, 20), (0, 10), causal=False)]


def test_parts_one_sample_spans_are_joined_into_one_call():
    """cp = 4 on one 80-token sample (chunks of 10): every block is at most two flash calls,
    and none merges or sums (their query ranges never overlap)."""
    def runs(chunks):
        return runs_of([(i * 10, c * 10, 0) for i, c in enumerate(chunks)], 20)

    ranks = [runs([r, 7 - r]) for r in range(4)]
    # Rank 1 (chunks 1, 6) against rank 0 (chunks 0, 7): both query chunks see chunk 0 whole.
    assert plan_block(ranks[1], ranks[0]) == [Part((0, 20), (0, 10), (0, 20), (0, 10), causal=False)]
    # Rank 1 against rank 2 (chunks 2, 5): chunk 6 sees both whole; chunk 1 sees neither.
    assert plan_block(ranks[1], ranks[2]) == [Part((10, 20), (0, 20), (0, 10), (0, 20), causal=False)]
    for mine in ranks:
        for theirs in ranks:
            plan = plan_block(mine, theirs)
            assert len(plan) <= 2
            assert not _overlapping([p.q for p in plan])


def test_parts_of_different_samples_stay_apart():
    """Two samples: chunk 3's first sample spans from chunk 0, its second starts inside chunk 3;
    the causal call keeps both as sequences, the first with chunk 0's tail in front."""
    q = runs_of([(0, 0, 0), (10, 30, 0), (15, 35, 1)], 20)  # chunks 0 and 3 of a 40-token row
    assert plan_block(q, q) == [Part((0, 10), (0, 10), (0, 10), (0, 10), causal=True),
                                Part((10, 20), (0, 20), (0, 5, 10), (0, 15, 20), causal=True)]
    apart = runs_of([(0, 0, 0), (10, 30, 1)], 20)  # sample 0 ends before chunk 3: nothing spans
    assert plan_block(apart, apart) == [Part((0, 10), (0, 10), (0, 10), (0, 10), causal=True),
                                        Part((10, 20), (10, 20), (0, 10), (0, 10), causal=True)]


def test_only_the_spanning_sample_connects_earlier_keys():
    """Samples 0 (row 0-14) and 1 (15-39): queries of chunk 3 (30-39) see keys of chunk 0
    (0-9) only if one sample spans both; here none does."""
    q = runs_of([(0, 30, 1)], 10)
    k = runs_of([(0, 0, 0)], 10)
    assert plan_block(q, k) == []
    k_spanning = runs_of([(0, 0, 0), (5, 5, 1)], 10)  # sample 1 starts at row 5 and reaches row 39
    assert plan_block(q, k_spanning) == [Part((0, 10), (5, 10), (0, 10), (0, 5), causal=False)]


def test_partly_overlapping_runs_go_to_the_eager_kernel():
    assert plan_block(runs_of([(0, 5, 0)], 10), runs_of([(0, 0, 0)], 10)) is None


def test_the_kernel_is_chosen_per_call():
    from prime_plugin_cp.strategy import block_kernel

    q = torch.zeros(8, 4, 16, dtype=torch.bfloat16)
    assert block_kernel("auto", q) is EAGER and block_kernel("eager", q) is EAGER
    for name in ("flash", "cudnn"):
        with pytest.raises(ValueError, match=f"cp_ring_kernel = '{name}' cannot run here: it needs CUDA tensors"):
            block_kernel(name, q)


def test_cudnn_runs_every_zigzag_part_of_one_sample_but_the_joined_diagonal_one():
    """cp = 4, one 80-token sample: the parts cuDNN's unmasked or square-causal call can run."""
    from prime_plugin_cp.cudnn_block import cudnn_fits

    def runs(chunks):
        return runs_of([(i * 10, c * 10, 0) for i, c in enumerate(chunks)], 20)

    ranks = [runs([r, 7 - r]) for r in range(4)]
    for r, mine in enumerate(ranks):
        for s, theirs in enumerate(ranks):
            fits = [cudnn_fits(part) for part in plan_block(mine, theirs)]
            # Rank 3's chunks (3, 4) are one run: its diagonal block is a single square call.
            assert fits == ([True, False] if r == s != 3 else [True]), (r, s, fits)
    packed = runs_of([(0, 0, 0), (4, 4, 1)], 10)  # two samples in one causal call: flash's varlen
    assert [cudnn_fits(part) for part in plan_block(packed, packed)] == [False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("name", ["flash", "cudnn"])
def test_torch_fused_kernels_in_the_ring_match_dense_attention_on_a_gpu(cp, name):
    """The real kernels: bf16 ring (flash blocks, or cuDNN's where a part allows) against the
    float64 dense reference, beside the eager block kernel on the same bf16 inputs (its error
    is the bound's scale). One 125-token row of three samples, and one sample filling the row
    (every part but the diagonal's joined one on cuDNN)."""
    from prime_plugin_cp.cudnn_block import CUDNN

    kernel = {"flash": FLASH, "cudnn": CUDNN}[name]
    for lengths in (UNEVEN, (128,)):
        errors = _errors(kernel, cp, dtype=torch.bfloat16, device="cuda", hq=16, hkv=8, lengths=lengths)
        eager = _errors(EAGER, cp, dtype=torch.bfloat16, device="cuda", hq=16, hkv=8, lengths=lengths)
        for key, value in errors.items():
            assert value <= 2 * eager[key] + 1e-2, (lengths, key, errors, eager)
