"""The Triton kernel of ``adamw`` (imported by it on first use: this module imports triton).
See ``adamw`` for what it computes."""

import triton
import triton.language as tl

P, G, M, V, C, N = (tl.constexpr(column) for column in range(6))
"""The columns of the address table: master, gradient, first and second moment, compute copy
(0: none) addresses, and the size."""


@triton.jit
def _round_to_bf16(x):
    """``x`` rounded to the nearest bfloat16, ties to even, still in float32: the cast that
    follows is then exact. The GPU's cast rounds so too; Triton's interpreter truncates."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _aligned(address, dtype: tl.constexpr):
    """The address as a pointer to ``dtype`` (``adamw.step`` checks that every address is
    16-byte aligned, which lets the compiler read 16 bytes at a time)."""
    return tl.multiple_of(address.to(tl.pointer_type(dtype)), 16)


@triton.jit
def _load(pointer, offs, inside, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(pointer + offs, mask=inside, other=0.0).to(tl.float32)
    return tl.load(pointer + offs).to(tl.float32)


@triton.jit
def _store(pointer, offs, value, inside, MASKED: tl.constexpr):
    if MASKED:
        tl.store(pointer + offs, value, mask=inside)
    else:
        tl.store(pointer + offs, value)


@triton.jit
def _store_as(pointer, offs, value, inside, dtype: tl.constexpr, MASKED: tl.constexpr):
    """``value`` (float32) stored as ``dtype``: bfloat16 rounded to nearest, ties to even."""
    if dtype == tl.bfloat16:
        _store(pointer, offs, _round_to_bf16(value).to(tl.bfloat16), inside, MASKED)
    else:
        _store(pointer, offs, value, inside, MASKED)


@triton.jit
def _update(row, offs, inside, clip, lr_decay, one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps,
            GRAD: tl.constexpr, PARAM: tl.constexpr, COPY: tl.constexpr, MASKED: tl.constexpr, ROUNDED: tl.constexpr):
    p_ptr = _aligned(tl.load(row + P), PARAM)
    m_ptr = _aligned(tl.load(row + M), PARAM)
    v_ptr = _aligned(tl.load(row + V), PARAM)
    g = _load(_aligned(tl.load(row + G), GRAD), offs, inside, MASKED) * tl.load(clip)
    p = _load(p_ptr, offs, inside, MASKED) * lr_decay
    m = _load(m_ptr, offs, inside, MASKED)
    v = _load(v_ptr, offs, inside, MASKED)
    m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + one_minus_beta2 * (g * g)
    if ROUNDED:  # see adamw's docstring
        p = p - step_size * (m / (tl.sqrt(v) / bc2_sqrt + eps))
    else:
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        p = p - step_size * tl.div_rn(m, denom)
    _store_as(p_ptr, offs, p, inside, PARAM, MASKED)
    _store_as(m_ptr, offs, m, inside, PARAM, MASKED)
    _store_as(v_ptr, offs, v, inside, PARAM, MASKED)
    if COPY:
        _store_as(_aligned(tl.load(row + C), tl.bfloat16), offs, p, inside, tl.bfloat16, MASKED)


@triton.jit
def _block(table, items, first, BLOCK: tl.constexpr):
    """This program's tensor (its ``table`` row), where its ``BLOCK`` starts, the block's offsets,
    and the tensor's size (0 where the row has no gradient address)."""
    i = tl.program_id(0)
    t = tl.load(items + i)
    row = table + t * 6
    n = tl.where(tl.load(row + G) != 0, tl.load(row + N), 0)
    start = (i - tl.load(first + t)).to(tl.int64) * BLOCK
    return row, start, start + tl.arange(0, BLOCK), n


@triton.jit
def adamw(table, items, first, clip, lr_decay, one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps,
          GRAD: tl.constexpr, PARAM: tl.constexpr, COPY: tl.constexpr, BLOCK: tl.constexpr, ROUNDED: tl.constexpr):
    """One AdamW step over one ``BLOCK`` of one tensor. ``items[i]`` is the tensor of program
    ``i`` and ``first[t]`` its first program; ``table[t]`` holds the tensor's five addresses
    and its size (a zero gradient address: not stepped in this launch). The parameter and its
    moments are ``PARAM`` (the arithmetic is float32 whatever they are); ``COPY``: a bfloat16
    compute copy is written too; ``ROUNDED``: the results are only kept rounded to bfloat16, so
    division and square root may be the fast ones. Whole blocks are read without a mask: a mask
    against a size the compiler cannot see into splits every access into single elements."""
    row, start, offs, n = _block(table, items, first, BLOCK)
    inside = offs < n
    if start + BLOCK <= n:
        _update(row, offs, inside, clip, lr_decay, one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps,
                GRAD, PARAM, COPY, False, ROUNDED)
    elif start < n:
        _update(row, offs, inside, clip, lr_decay, one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps,
                GRAD, PARAM, COPY, True, ROUNDED)


@triton.jit
def squares_of_table(table, count, out, GRAD: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """``squares`` over ``count`` (at most ``ROWS``) gradients in one launch: ``table[t]`` holds
    gradient ``t``'s address, size, first slot of ``out`` and first program. Each program finds its
    gradient among the rows' first programs and sums one ``BLOCK`` as ``squares`` does, into the
    same slot: the same partial sums, from one launch instead of ``count``."""
    i = tl.program_id(0)
    rows = tl.arange(0, ROWS)
    firsts = tl.load(table + rows * 4 + 3, mask=rows < count, other=i + 1)
    t = tl.sum((firsts <= i).to(tl.int32), axis=0) - 1
    row = table + t * 4
    j = i - tl.load(row + 3)
    n = tl.load(row + 1)
    start = j.to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    inside = offs < n
    pointer = _aligned(tl.load(row), GRAD)
    if start + BLOCK <= n:
        g = _load(pointer, offs, inside, False)
    else:
        g = _load(pointer, offs, inside, True)
    tl.store(out + tl.load(row + 2) + j, tl.sum(g * g, axis=0))


@triton.jit
def squares(grad, n, out, BLOCK: tl.constexpr):
    """``out[i]``: the sum of the squares, in float32, of the ``i``-th ``BLOCK`` of the ``n``
    elements of ``grad`` (a 16-byte aligned tensor)."""
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    inside = offs < n
    pointer = tl.multiple_of(grad, 16)
    if start + BLOCK <= n:
        g = _load(pointer, offs, inside, False)
    else:
        g = _load(pointer, offs, inside, True)
    tl.store(out + tl.program_id(0), tl.sum(g * g, axis=0))
