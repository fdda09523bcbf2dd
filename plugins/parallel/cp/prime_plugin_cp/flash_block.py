"""The ring's block kernel on torch's bundled flash-attention varlen kernel, which returns the
log-sum-exp the ring merges with (``aten._flash_attention_forward`` / ``_backward``; CUDA,
bf16/fp16, head dim up to 256).

A block is this rank's queries against one rank's keys. Under the CP split each rank holds a
few contiguous runs of the row (``cp_indices``: chunks ``r`` and ``2 cp − 1 − r``), so every
(query run, key run) pair is one of three shapes, each one flash call:

- the same run: causal attention within each sample of the run (varlen, the samples'
  boundaries as sequences);
- keys entirely before the queries: only the sample that spans from the end of the key run to
  the start of the query run connects them, and it sees every key (no mask);
- keys after the queries: nothing.

Neighbouring calls that the spanning sample connects are then joined into one (``coalesce``),
so that under the zigzag split every block is at most two calls on disjoint query rows: their
outputs need no merge and the query gradients no sum. Where parts do share rows, their outputs
merge by log-sum-exp like the ring's blocks and their gradients add in float32. The backward
pass calls flash's backward per part with the ring's final output and log-sum-exp (so each
part's probabilities are the full softmax's, as the eager kernel's recomputation has them). Any
other pattern (runs that partly overlap) goes to the eager kernel. The plan of every block (the
runs and samples, one host sync) is made by ``prepare`` once per packing (``ring.layout``) and
serves every layer, forward and backward.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any

from prime_plugin_cp.block import BlockKernel, acc_dtype, block_backward, block_forward

MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class Part:
    """One flash call of a block: queries ``q`` and keys ``k`` (local token ranges),
    sequences ``cu_q`` / ``cu_k`` (offsets inside the ranges), ``causal`` or not."""

    q: tuple[int, int]
    k: tuple[int, int]
    cu_q: tuple[int, ...]
    cu_k: tuple[int, ...]
    causal: bool
    offsets: Any = field(default=None, compare=False, repr=False)
    """``(cu_q, cu_k)`` as int32 device tensors, made by ``prepare`` in one copy: a copy per
    call from host memory would wait for the GPU each time."""

    @property
    def max_q(self) -> int:
        return max(b - a for a, b in zip(self.cu_q, self.cu_q[1:], strict=False))

    @property
    def max_k(self) -> int:
        return max(b - a for a, b in zip(self.cu_k, self.cu_k[1:], strict=False))


@dataclass(frozen=True)
class Run:
    """Local tokens ``[start, end)`` whose row positions are consecutive from ``index``; its
    samples as ``(local start, local end, segment id)``."""

    start: int
    end: int
    index: int
    pieces: tuple[tuple[int, int, int], ...]

    @property
    def stop(self) -> int:
        """The row position after the run's last token."""
        return self.index + self.end - self.start


def runs_of(boundaries: list[tuple[int, int, int]], length: int) -> list[Run]:
    """Runs from the positions where a new piece starts, ``(local position, row index,
    segment)``, in order (the first at position 0)."""
    runs: list[Run] = []
    pieces: list[tuple[int, int, int]] = []
    start = index = 0
    for number, (pos, row, seg) in enumerate(boundaries):
        end = boundaries[number + 1][0] if number + 1 < len(boundaries) else length
        if pieces and row != index + (pos - start):  # a jump in the row: a new run
            runs.append(Run(start, pos, index, tuple(pieces)))
            pieces = []
        if not pieces:
            start, index = pos, row
        if pieces and pieces[-1][2] == seg:  # the same sample goes on
            pieces[-1] = (pieces[-1][0], end, seg)
        else:
            pieces.append((pos, end, seg))
    if pieces:
        runs.append(Run(start, length, index, tuple(pieces)))
    return runs


def plan_block(queries: list[Run], keys: list[Run]) -> list[Part] | None:
    """The flash calls of one block, or ``None`` when a pair of runs partly overlaps."""
    parts = []
    for qr in queries:
        for kr in keys:
            if kr.index >= qr.stop:  # every key after every query
                continue
            if (kr.index, kr.stop) == (qr.index, qr.stop):
                cu = tuple(a - qr.start for a, _, _ in qr.pieces) + (qr.end - qr.start,)
                parts.append(Part((qr.start, qr.end), (kr.start, kr.end), cu, cu, causal=True))
            elif kr.stop <= qr.index:
                q_first, k_last = qr.pieces[0], kr.pieces[-1]
                if q_first[2] == k_last[2]:  # the sample that spans from the keys to the queries
                    parts.append(Part((q_first[0], q_first[1]), (k_last[0], k_last[1]), (0, q_first[1] - q_first[0]),
                                      (0, k_last[1] - k_last[0]), causal=False))
            else:
                return None
    return coalesce(parts)


def coalesce(parts: list[Part]) -> list[Part]:
    """The same attention in fewer flash calls: neighbouring parts that one varlen call can
    run together are joined (``_join``), so their outputs need no merge and their gradients no
    sum."""
    done: list[Part] = []
    for part in parts:
        joined = _join(done[-1], part) if done else None
        if joined is None:
            done.append(part)
        else:
            done[-1] = joined
    return done


def _join(a: Part, b: Part) -> Part | None:
    """One part doing what ``a`` then ``b`` do, or ``None``. Three shapes arise under the
    zigzag split, each because one sample spans both parts' keys (or queries):

    - the same queries, every key of both (unmasked) and the keys adjacent: one unmasked call
      over both key ranges;
    - the same keys (unmasked) and the queries adjacent: one unmasked call over both query
      ranges;
    - ``a`` the spanning sample's queries over its earlier keys (unmasked), ``b`` the causal
      run whose first sequence is those queries, its keys right after ``a``'s: one causal
      call whose first sequence has the earlier keys in front. Flash aligns a causal mask to
      the bottom right when a sequence has more keys than queries, so those queries see
      every earlier key and the rest causally."""
    single = len(a.cu_q) == 2 and len(a.cu_k) == 2
    if a.causal or not single:
        return None
    if not b.causal and len(b.cu_q) == 2 and len(b.cu_k) == 2:
        if a.q == b.q and a.k[1] == b.k[0]:
            keys = b.k[1] - a.k[0]
            return Part(a.q, (a.k[0], b.k[1]), a.cu_q, (0, keys), causal=False)
        if a.k == b.k and a.q[1] == b.q[0]:
            queries = b.q[1] - a.q[0]
            return Part((a.q[0], b.q[1]), a.k, (0, queries), a.cu_k, causal=False)
        return None
    if b.causal and a.q == (b.q[0], b.q[0] + b.cu_q[1]) and a.k[1] == b.k[0] and b.cu_q == b.cu_k:
        extra = a.k[1] - a.k[0]
        return Part(b.q, (a.k[0], b.k[1]), b.cu_q, (0, *(c + extra for c in b.cu_k[1:])), causal=True)
    return None


def prepare(meta, rank: int) -> list[list[Part] | None]:
    """For ``meta [n, 2, L]`` (every rank's row positions and sample ids), the plan of each
    block of rank ``rank``'s queries, by source rank; one host sync."""
    import torch

    n, _, length = meta.shape
    index, seg = meta[:, 0], meta[:, 1]
    new = torch.ones(n, length, dtype=torch.bool, device=meta.device)
    if length > 1:
        new[:, 1:] = (index[:, 1:] != index[:, :-1] + 1) | (seg[:, 1:] != seg[:, :-1])
    ranks, pos = new.nonzero(as_tuple=True)
    rows = torch.stack([ranks, pos, index[ranks, pos], seg[ranks, pos]]).tolist()
    boundaries: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
    for r, p, i, s in zip(*rows, strict=True):
        boundaries[r].append((p, i, s))
    runs = [runs_of(b, length) for b in boundaries]
    return with_offsets([plan_block(runs[rank], runs[source]) for source in range(n)], meta.device)


def with_offsets(plans: list[list[Part] | None], device) -> list[list[Part] | None]:
    """The plans with every part's sequence offsets on ``device``, copied at once."""
    import torch

    flat = [offset for plan in plans if plan for part in plan for offset in (*part.cu_q, *part.cu_k)]
    if not flat:
        return plans
    offsets = torch.tensor(flat, dtype=torch.int32).to(device, non_blocking=True)
    done, start = [], 0
    for plan in plans:
        if not plan:
            done.append(plan)
            continue
        parts = []
        for part in plan:
            nq, nk = len(part.cu_q), len(part.cu_k)
            parts.append(replace(part, offsets=(offsets[start:start + nq], offsets[start + nq:start + nq + nk])))
            start += nq + nk
        done.append(parts)
    return done


# ------------------------------------------------------------------ the varlen calls


def _offsets(part: Part, device):
    if part.offsets is not None:
        return part.offsets
    import torch

    return (torch.tensor(part.cu_q, dtype=torch.int32, device=device),
            torch.tensor(part.cu_k, dtype=torch.int32, device=device))


def flash_forward_part(q, k, v, part: Part, scale):
    """``(out [n, Hq, D] in q's dtype, lse [Hq, n] float32)`` of one part."""
    import torch

    cu_q, cu_k = _offsets(part, q.device)
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, part.max_q, part.max_k, 0.0, part.causal, False, scale=scale)
    return out, lse


def flash_backward_part(dout, q, k, v, out, lse, part: Part, scale):
    """``(dq, dk, dv)`` of one part, from the final output and log-sum-exp ``lse [Hq, n]``."""
    import torch

    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: never read
    unused = torch.empty(0, device=q.device)
    cu_q, cu_k = _offsets(part, q.device)
    return torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, cu_q, cu_k, part.max_q, part.max_k, 0.0, part.causal, rng_state, unused,
        scale=scale)


class FlashBlocks:
    """The kernel's calls; tests put an eager emulation of flash's contract in their place."""

    forward = staticmethod(flash_forward_part)
    backward = staticmethod(flash_backward_part)


def make_kernel(calls=FlashBlocks) -> BlockKernel:
    """A ``BlockKernel`` running each block's parts through ``calls``."""

    def forward(q, k, v, q_index, q_seg, k_index, k_seg, scale, *, plan=None):
        if plan is None:
            return block_forward(q, k, v, q_index, q_seg, k_index, k_seg, scale)
        from prime_plugin_cp.ring import merge

        results = [calls.forward(q[p.q[0]:p.q[1]], k[p.k[0]:p.k[1]], v[p.k[0]:p.k[1]], p, scale) for p in plan]
        if len(plan) == 1 and plan[0].q == (0, q.shape[0]):  # one call gave every row: nothing to add
            return results[0][0], results[0][1].t()
        # Parts on rows no other part writes keep flash's output dtype (copies, no rounding);
        # only rows two parts share are merged, in the accumulation dtype.
        ranges = [p.q for p in plan]
        shared = _overlapping(ranges)
        out = _buffer(q.shape, acc_dtype(q.dtype) if shared else q.dtype, ranges, shared, q.device, 0.0)
        lse = _buffer(q.shape[:2], acc_dtype(q.dtype), ranges, shared, q.device, float("-inf"))
        written = _Touched()
        for part, (part_out, part_lse) in zip(plan, results, strict=True):
            (qa, qb) = part.q
            if written.first(qa, qb):
                out[qa:qb].copy_(part_out)
                lse[qa:qb].copy_(part_lse.t())
            else:
                merge(out[qa:qb], lse[qa:qb], part_out.to(out.dtype), part_lse.t().to(lse.dtype))
        return out, lse

    def backward(dout, q, k, v, lse, delta, q_index, q_seg, k_index, k_seg, scale, *, out=None, plan=None):
        if plan is None or out is None:
            return block_backward(dout, q, k, v, lse, delta, q_index, q_seg, k_index, k_seg, scale)
        lse_t = lse.t()  # the accumulation dtype: float32 for flash's bf16/fp16
        grads = [calls.backward(dout[p.q[0]:p.q[1]], q[p.q[0]:p.q[1]], k[p.k[0]:p.k[1]], v[p.k[0]:p.k[1]],
                                out[p.q[0]:p.q[1]], lse_t[:, p.q[0]:p.q[1]].contiguous(), p, scale) for p in plan]
        if len(plan) == 1 and plan[0].q == (0, q.shape[0]) and plan[0].k == (0, k.shape[0]):
            return grads[0]
        dq = _gathered(q, [p.q for p in plan], [g[0] for g in grads])
        dk = _gathered(k, [p.k for p in plan], [g[1] for g in grads])
        dv = _gathered(v, [p.k for p in plan], [g[2] for g in grads])
        return dq, dk, dv

    return BlockKernel(forward=forward, backward=backward, prepare=prepare)


def _overlapping(ranges: list[tuple[int, int]]) -> bool:
    ordered = sorted(ranges)
    return any(b > c for (_, b), (c, _) in zip(ordered, ordered[1:], strict=False))


def _buffer(shape, dtype, ranges: list[tuple[int, int]], shared: bool, device, fill: float):
    """A ``shape`` tensor holding ``fill`` wherever no part will copy its result first: every
    row when some parts share rows (a part may then merge into rows nobody wrote yet), else
    only the rows outside every range (filling the others would be a wasted pass)."""
    import torch

    if shared:
        return torch.full(shape, fill, dtype=dtype, device=device)
    buffer = torch.empty(shape, dtype=dtype, device=device)
    start = 0
    for a, b in sorted(ranges):
        if a > start:
            buffer[start:a].fill_(fill)
        start = max(start, b)
    if start < shape[0]:
        buffer[start:].fill_(fill)
    return buffer


def _gathered(like, ranges: list[tuple[int, int]], values):
    """The parts' gradients ``values`` placed at their ``ranges`` of a tensor shaped ``like``
    (zero elsewhere): kept in their own dtype where no two parts share rows, summed in the
    accumulation dtype where they do."""
    shared = _overlapping(ranges)
    into = _buffer(like.shape, acc_dtype(like.dtype) if shared else like.dtype, ranges, shared, like.device, 0.0)
    written = _Touched()
    for (a, b), value in zip(ranges, values, strict=True):
        if written.first(a, b):
            into[a:b].copy_(value)
        else:
            into[a:b] += value
    return into


class _Touched:
    """Which local token ranges of a block's result some part has written: a part landing on
    rows nobody wrote copies its result there (one pass) instead of merging or adding into
    filled rows (three to six passes)."""

    def __init__(self):
        self.ranges: list[tuple[int, int]] = []

    def first(self, start: int, end: int) -> bool:
        fresh = all(end <= a or b <= start for a, b in self.ranges)
        self.ranges.append((start, end))
        return fresh


FLASH = make_kernel()


def unavailable(q) -> str | None:
    """Why the flash block kernel cannot run on ``q`` (``None`` when it can)."""
    import torch

    if not q.is_cuda:
        return "it needs CUDA tensors"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"it runs in bfloat16 or float16, not {q.dtype}"
    if not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return f"torch {torch.__version__} has no aten._flash_attention_forward"
    if q.shape[-1] > MAX_HEAD_DIM or q.shape[-1] % 8:
        return f"flash attention takes head dims up to {MAX_HEAD_DIM} in multiples of 8, not {q.shape[-1]}"
    if _major(q.device.index if q.device.index is not None else torch.cuda.current_device()) < 8:
        return "flash attention needs an Ampere or newer GPU"
    return None


@functools.cache
def _major(index: int) -> int:
    import torch

    return torch.cuda.get_device_capability(index)[0]
