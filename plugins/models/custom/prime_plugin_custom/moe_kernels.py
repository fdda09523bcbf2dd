"""The Triton kernels of ``moe_triton`` (imported by it on first use: this module imports
triton). See ``moe_triton`` for what they compute.

A program takes one token and ``SPAN`` of its features (grid ``[tokens, cdiv(H, SPAN)]``), in
``[COPIES_P2, BLOCK]`` tiles: the token's ``COPIES`` rows in the permuted layout are
``inverse[token * COPIES + j]`` (copies padded to a power of two and masked)."""

import triton
import triton.language as tl


@triton.jit
def copy_rows(src, inverse, weight, dst, other, dots, H, COPIES: tl.constexpr, COPIES_P2: tl.constexpr,
              WEIGHTED: tl.constexpr, DOT: tl.constexpr, BLOCK: tl.constexpr, SPAN: tl.constexpr):
    """``dst[inverse[t * COPIES + j]] = src[t] (* weight[t, j])``; with ``DOT`` also this
    span's part of ``<src[t], other[inverse[t * COPIES + j]]>``, in float32, at
    ``dots[t, j, span]``."""
    token = tl.program_id(0).to(tl.int64)
    span = tl.program_id(1)
    j = tl.arange(0, COPIES_P2)
    valid = j < COPIES
    rows = tl.load(inverse + token * COPIES + j, mask=valid, other=0).to(tl.int64)
    if WEIGHTED:
        w = tl.load(weight + token * COPIES + j, mask=valid, other=0.0).to(tl.float32)
    if DOT:
        acc = tl.zeros([COPIES_P2, BLOCK], dtype=tl.float32)
    for start in range(0, SPAN, BLOCK):
        cols = span * SPAN + start + tl.arange(0, BLOCK)
        inside = cols < H
        v = tl.load(src + token * H + cols, mask=inside, other=0.0).to(tl.float32)
        tile = tl.broadcast_to(v[None, :], (COPIES_P2, BLOCK))
        if WEIGHTED:
            tile = tile * w[:, None]
        where = rows[:, None] * H + cols[None, :]
        both = valid[:, None] & inside[None, :]
        tl.store(dst + where, tile.to(dst.dtype.element_ty), mask=both)
        if DOT:
            acc += v[None, :] * tl.load(other + where, mask=both, other=0.0).to(tl.float32)
    if DOT:
        tl.store(dots + (token * COPIES + j) * tl.num_programs(1) + span, tl.sum(acc, axis=1), mask=valid)


@triton.jit
def sum_rows(src, inverse, weight, dst, H, COPIES: tl.constexpr, COPIES_P2: tl.constexpr,
             WEIGHTED: tl.constexpr, BLOCK: tl.constexpr, SPAN: tl.constexpr):
    """``dst[t] = sum_j src[inverse[t * COPIES + j]] (* weight[t, j])``, summed in float32 and
    rounded once."""
    token = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, COPIES_P2)
    valid = j < COPIES
    rows = tl.load(inverse + token * COPIES + j, mask=valid, other=0).to(tl.int64)
    if WEIGHTED:
        w = tl.load(weight + token * COPIES + j, mask=valid, other=0.0).to(tl.float32)
    for start in range(0, SPAN, BLOCK):
        cols = tl.program_id(1) * SPAN + start + tl.arange(0, BLOCK)
        inside = cols < H
        tile = tl.load(src + rows[:, None] * H + cols[None, :], mask=valid[:, None] & inside[None, :],
                       other=0.0).to(tl.float32)
        if WEIGHTED:
            tile = tile * w[:, None]
        tl.store(dst + token * H + cols, tl.sum(tile, axis=0).to(dst.dtype.element_ty), mask=inside)
