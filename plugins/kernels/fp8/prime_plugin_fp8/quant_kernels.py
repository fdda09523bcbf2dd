"""The Triton kernels of ``triton_quant`` (imported by it on first use: this module imports
triton). See ``triton_quant`` for what they compute."""

import triton
import triton.language as tl


@triton.jit
def _round_to_e4m3(y):
    """``y`` (float32, within ±448) rounded to the nearest e4m3 value, ties to even, still in
    float32: what the GPU's cast does, for Triton's interpreter, whose own float32 -> e4m3 cast
    rounds some values wrongly (126.3 to 64)."""
    e = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # the binade; 0 and tiny values: -127
    e = tl.maximum(e, -6)  # e4m3's subnormals are spaced like its smallest binade
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3): 3 mantissa bits
    inverse = ((127 - (e - 3)) << 23).to(tl.float32, bitcast=True)
    t = y * inverse  # exact: a power of two; |t| <= 16
    r = (t + 12582912.0) - 12582912.0  # 1.5 * 2^23: float32 addition rounds t to even
    return tl.where(r == 0.0, y * 0.0, r * step)  # a negative value rounding to zero stays -0


@triton.jit
def _quantise(v, amax, SOFT_ROUND: tl.constexpr):
    # quant._scales and quant._cast: the scale an exact division, a zero scale replaced by 1,
    # the values multiplied by its exact reciprocal (one division per block, not per value).
    # Compiled, the cast that follows rounds to nearest even in hardware; SOFT_ROUND (the
    # interpreter) rounds here, still in float32 (e4m3 exactly representable), so that any cast
    # after it is exact.
    s = tl.div_rn(amax, 448.0)
    s = tl.where(s == 0.0, 1.0, s)
    y = tl.clamp(v * tl.div_rn(1.0, s), -448.0, 448.0)
    if SOFT_ROUND:
        y = _round_to_e4m3(y)
    return s, y


@triton.jit
def _rows_tile(x, stride_m, stride_k, q, scale, stride_sm, stride_sk, m, k, kp, row_group, block_group,
               BLOCK: tl.constexpr, ROWS: tl.constexpr, BLOCKS: tl.constexpr, SOFT_ROUND: tl.constexpr):
    """One ``ROWS`` x ``BLOCKS`` * 128 tile of ``x``: each row's ``BLOCKS`` 1 x 128 blocks."""
    r = row_group * ROWS + tl.arange(0, ROWS)
    b = block_group * BLOCKS + tl.arange(0, BLOCKS)
    c = block_group * (BLOCKS * BLOCK) + tl.arange(0, BLOCKS * BLOCK)
    r64 = r.to(tl.int64)
    inside = (r[:, None] < m) & (c[None, :] < k)
    v = tl.load(x + r64[:, None] * stride_m + c[None, :] * stride_k, mask=inside, other=0.0).to(tl.float32)
    v = tl.reshape(v, (ROWS, BLOCKS, BLOCK))
    s, qv = _quantise(v, tl.max(tl.abs(v), axis=2)[:, :, None], SOFT_ROUND)
    qv = tl.reshape(qv, (ROWS, BLOCKS * BLOCK))
    tl.store(q + r64[:, None] * kp + c[None, :], qv.to(tl.float8e4nv), mask=(r[:, None] < m) & (c[None, :] < kp))
    tl.store(scale + r64[:, None] * stride_sm + b[None, :] * stride_sk, tl.max(s, axis=2),
             mask=(r[:, None] < m) & (b[None, :] < kp // BLOCK))


@triton.jit
def _block_tile(w, stride_n, stride_k, q, scale, n, k, columns, rb, cb, BLOCK: tl.constexpr,
                SOFT_ROUND: tl.constexpr, TRANSPOSE: tl.constexpr):
    """The 128 x 128 block ``(rb, cb)`` of ``w [n, k]``: into ``q [n, columns]`` (``columns`` =
    padded k) and ``scale[rb, cb]``; or, ``TRANSPOSE``, as ``w.T``'s block ``(cb, rb)`` into
    ``q [k, columns]`` (``columns`` = padded n) and ``scale[cb, rb]``. Either way ``w`` is read
    along its own rows: a transposed read of a row-major weight is slower (stop 59)."""
    r = rb * BLOCK + tl.arange(0, BLOCK)
    c = cb * BLOCK + tl.arange(0, BLOCK)
    r64, c64 = r.to(tl.int64), c.to(tl.int64)
    v = tl.load(w + r64[:, None] * stride_n + c64[None, :] * stride_k, mask=(r[:, None] < n) & (c[None, :] < k),
                other=0.0).to(tl.float32)
    s, qv = _quantise(v, tl.max(tl.max(tl.abs(v), axis=1), axis=0), SOFT_ROUND)
    if TRANSPOSE:
        tl.store(q + c64[:, None] * columns + r64[None, :], tl.trans(qv).to(tl.float8e4nv),
                 mask=(c[:, None] < k) & (r[None, :] < columns))
        tl.store(scale + cb * (columns // BLOCK) + rb, s)
    else:
        tl.store(q + r64[:, None] * columns + c64[None, :], qv.to(tl.float8e4nv),
                 mask=(r[:, None] < n) & (c[None, :] < columns))
        tl.store(scale + rb * (columns // BLOCK) + cb, s)


@triton.jit
def rows(x, stride_m, stride_k, q, scale, stride_sm, stride_sk, m, k, kp, BLOCK: tl.constexpr, ROWS: tl.constexpr,
         BLOCKS: tl.constexpr, SOFT_ROUND: tl.constexpr):
    _rows_tile(x, stride_m, stride_k, q, scale, stride_sm, stride_sk, m, k, kp, tl.program_id(0), tl.program_id(1),
               BLOCK, ROWS, BLOCKS, SOFT_ROUND)


@triton.jit
def blocks(w, stride_n, stride_k, q, scale, n, k, columns, BLOCK: tl.constexpr, SOFT_ROUND: tl.constexpr,
           TRANSPOSE: tl.constexpr):
    _block_tile(w, stride_n, stride_k, q, scale, n, k, columns, tl.program_id(0), tl.program_id(1), BLOCK,
                SOFT_ROUND, TRANSPOSE)


@triton.jit
def rows_and_columns(x, stride_m, stride_k, q, scale, stride_sm, stride_sk, qt, scale_t, stride_tk, stride_tm, m, k,
                     kp, mp, BLOCK: tl.constexpr, SOFT_ROUND: tl.constexpr, TILES: tl.constexpr,
                     STAGES: tl.constexpr):
    """``TILES`` 128 x 128 tiles along one 128-row strip, each read once: ``rows``' output for
    ``x`` and for ``x.T`` (whose 1 x 128 blocks are this tile's columns), the latter stored
    transposed. ``STAGES`` > 1 loads the next tile while this one is stored."""
    rb = tl.program_id(0)
    r = rb * BLOCK + tl.arange(0, BLOCK)
    r64 = r.to(tl.int64)
    blocks = kp // BLOCK
    for t in tl.range(0, TILES, num_stages=STAGES):
        cb = tl.program_id(1) * TILES + t
        c = cb * BLOCK + tl.arange(0, BLOCK)
        c64 = c.to(tl.int64)
        v = tl.load(x + r64[:, None] * stride_m + c64[None, :] * stride_k,
                    mask=(r[:, None] < m) & (c[None, :] < k), other=0.0).to(tl.float32)
        magnitude = tl.abs(v)
        s, qv = _quantise(v, tl.max(magnitude, axis=1)[:, None], SOFT_ROUND)
        tl.store(q + r64[:, None] * kp + c64[None, :], qv.to(tl.float8e4nv),
                 mask=(r[:, None] < m) & (c[None, :] < kp))
        # (cb as a vector: Triton's interpreter refuses a scalar term in a mask)
        tl.store(scale + r64 * stride_sm + cb * stride_sk, tl.max(s, axis=1), mask=(r < m) & (r * 0 + cb < blocks))
        st, qvt = _quantise(v, tl.max(magnitude, axis=0)[None, :], SOFT_ROUND)
        # x.T's rows are this tile's columns (only the first k exist); its padding, rows m..mp
        # of x, was loaded as zeros and is stored as such.
        tl.store(qt + c64[:, None] * mp + r64[None, :], tl.trans(qvt).to(tl.float8e4nv), mask=c[:, None] < k)
        tl.store(scale_t + c64 * stride_tk + rb * stride_tm, tl.max(st, axis=0), mask=c < k)
