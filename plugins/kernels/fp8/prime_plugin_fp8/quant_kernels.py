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
def rows(x, stride_m, stride_k, q, scale, m, k, kp, BLOCK: tl.constexpr, ROWS: tl.constexpr,
         SOFT_ROUND: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    block = tl.program_id(1)
    c = block * BLOCK + tl.arange(0, BLOCK)
    r64 = r.to(tl.int64)
    inside = (r[:, None] < m) & (c[None, :] < k)
    v = tl.load(x + r64[:, None] * stride_m + c[None, :] * stride_k, mask=inside, other=0.0).to(tl.float32)
    s, qv = _quantise(v, tl.max(tl.abs(v), axis=1)[:, None], SOFT_ROUND)
    stored = (r[:, None] < m) & (c[None, :] < kp)
    tl.store(q + r64[:, None] * kp + c[None, :], qv.to(tl.float8e4nv), mask=stored)
    tl.store(scale + r64 * (kp // BLOCK) + block, tl.max(s, axis=1), mask=r < m)


@triton.jit
def blocks(w, stride_n, stride_k, q, scale, n, k, kp, BLOCK: tl.constexpr, SOFT_ROUND: tl.constexpr):
    rb, cb = tl.program_id(0), tl.program_id(1)
    r = rb * BLOCK + tl.arange(0, BLOCK)
    c = cb * BLOCK + tl.arange(0, BLOCK)
    r64 = r.to(tl.int64)
    inside = (r[:, None] < n) & (c[None, :] < k)
    v = tl.load(w + r64[:, None] * stride_n + c[None, :] * stride_k, mask=inside, other=0.0).to(tl.float32)
    s, qv = _quantise(v, tl.max(tl.max(tl.abs(v), axis=1), axis=0), SOFT_ROUND)
    tl.store(q + r64[:, None] * kp + c[None, :], qv.to(tl.float8e4nv), mask=(r[:, None] < n) & (c[None, :] < kp))
    tl.store(scale + rb * (kp // BLOCK) + cb, s)


@triton.jit
def rows_and_columns(x, stride_m, stride_k, q, scale, qt, scale_t, m, k, kp, mp, BLOCK: tl.constexpr,
                     SOFT_ROUND: tl.constexpr, TILES: tl.constexpr, STAGES: tl.constexpr):
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
        tl.store(scale + r64 * blocks + cb, tl.max(s, axis=1), mask=(r < m) & (r * 0 + cb < blocks))
        st, qvt = _quantise(v, tl.max(magnitude, axis=0)[None, :], SOFT_ROUND)
        # x.T's rows are this tile's columns (only the first k exist); its padding, rows m..mp
        # of x, was loaded as zeros and is stored as such.
        tl.store(qt + c64[:, None] * mp + r64[None, :], tl.trans(qvt).to(tl.float8e4nv), mask=c[:, None] < k)
        tl.store(scale_t + c64 * (mp // BLOCK) + rb, tl.max(st, axis=0), mask=c < k)
