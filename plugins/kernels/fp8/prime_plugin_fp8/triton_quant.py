"""``quant``'s block-scaled quantisers as one Triton kernel each, for CUDA tensors.

The PyTorch quantisers make several passes over a float32 copy of their input (cast, pad,
``abs``, ``amax``, divide, clamp, cast); at M = 8,192 they cost more than the FP8 GEMMs save.
Here every program loads one tile of the input once, in its own dtype and strides (a
transposed view of a gradient needs no copy), finds the block's ``amax`` in float32
registers and writes the FP8 values and the scale. The arithmetic is ``quant``'s: the scale
is ``amax / 448`` rounded to nearest (a division, as there), a zero scale becomes 1, values are
``x * (1 / scale)`` (the reciprocal rounded to nearest once per block), clamped to ±448, then
cast (round to nearest even). ``tests/test_triton_quant.py`` checks
the outputs bit for bit against ``quant``'s on fresh random inputs, through Triton's
interpreter on a CPU and compiled on a GPU. One difference: a NaN in a block is not carried
into its scale (``amax`` skips it); the PyTorch quantisers make the whole block NaN.

Each quantiser is also a ``torch.library.triton_op`` (``prime_fp8::quantize_*``), which is what
a graph being compiled gets: Inductor sees the kernel inside and launches it from its generated
code, where the eager call goes through Triton's Python launcher (40-54 µs of host time a
launch on the H200, stop 40; the FP8 linear is host-bound). Called eagerly the kernel is
launched directly, without the operator's dispatch. Registering the operators imports triton
(torch looks for the kernels in their functions): about 0.2 s, paid where FP8 is used or planned,
not when the plugin is listed.
"""

from __future__ import annotations

import functools

import torch
from torch.library import triton_op, wrap_triton

BLOCK = 128


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quant.quantize_rows`` in one kernel: ``x [M, K]`` (any float dtype and strides) ->
    ``(q [M, Kp] float8_e4m3fn, scale [M, Kp / 128] float32)``."""
    if torch.compiler.is_compiling():
        q, scale = _rows_op(x)
        return q, scales_of(scale, x.shape[0])
    return _rows(x, _direct)


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quant.quantize_blocks`` in one kernel: ``w [N, K]`` -> ``(q [N, Kp] float8_e4m3fn,
    scale [ceil(N / 128), Kp / 128] float32)``. A transposed view of a row-major weight (the
    input gradient's ``W.T``) is read along the weight's rows and stored transposed."""
    if torch.compiler.is_compiling():
        return _blocks_op(w)
    return _blocks(w, _direct)


def quantize_rows_and_columns(x: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor],
                                                          tuple[torch.Tensor, torch.Tensor]]:
    """``(quantize_rows(x), quantize_rows(x.T))`` from one read of ``x [M, K]``: a linear's
    input (its forward GEMM, and its weight gradient's along the tokens) and its output's
    gradient (the input gradient's GEMM and the weight gradient's). 128 x 128 tiles, each
    writing its rows' and its columns' blocks."""
    if torch.compiler.is_compiling():
        q, scale, qt, scale_t = _rows_and_columns_op(x)
        return (q, scales_of(scale, x.shape[0])), (qt, scales_of(scale_t, x.shape[1]))
    q, scale, qt, scale_t = _rows_and_columns(x, _direct)
    return (q, scale), (qt, scale_t)


# ---- the launches: ``launch`` is ``wrap_triton`` inside an operator, ``_direct`` eagerly ----

def _direct(kernel):
    return kernel


def row_scales(m: int, blocks: int, device) -> torch.Tensor:
    """An empty ``[blocks, aligned]`` float32 buffer for the 1 x 128 scales of ``m`` rows, laid
    out as the GEMMs read them: along ``m`` first (column-major), each column starting 16-byte
    aligned (``aligned`` is ``m`` rounded up to 4). DeepGEMM takes that layout as it is (TMA loads
    a column of a tile's scales); given row-major scales it transposes them in a kernel of its own
    before every GEMM. cuBLASLt's blockwise scales are column-major too. The kernels write the
    buffer (row ``r``'s block ``b`` at ``b * aligned + r``) and ``scales_of`` gives the GEMMs'
    ``[m, blocks]`` view of it.

    A dense buffer, not an ``empty_strided`` tensor with gaps between its columns: under
    ``torch.compile`` with a symbolic row count (packed rows of varying length), Inductor did not
    let a kernel write into the latter in place; it cloned it first, and its decomposition of that
    clone failed on the symbolic strides (an ``InductorError`` in ``decompose_triton_kernel_
    wrapper_functional``; seen on an H200 in stop 70 with the tiny parity model)."""
    return torch.empty(blocks, -(-m // 4) * 4, dtype=torch.float32, device=device)


def scales_of(buffer: torch.Tensor, m: int) -> torch.Tensor:
    """The ``[m, blocks]`` scales (strides ``(1, aligned)``) in a ``row_scales`` buffer."""
    return buffer.t()[:m]


ROWS = {"rows": 32, "blocks": 1, "warps": 4}
"""``rows``' launch: rows a program (at least 32, so that a transposed input, contiguous along
the rows, is still read in whole cache lines), 1 x 128 blocks of each row, warps. On an H200
(``kernels_bench.py quant_rows``, stop 59) it runs at 3.7-3.9 TB/s at M = 8,192, faster than a
bf16 copy of the input (which moves a third more bytes). 16 rows of two blocks was 0.6-3.5%
faster, but compiled for a 1 x 1 input it wrote wrong values (stop 59's GPU tests), so it stays
a launch to time, not the default."""


def _rows(x, launch, rows=None, blocks=None, warps=None):
    q, scale = _rows_dense(x, launch, rows, blocks, warps)
    return q, scales_of(scale, x.shape[0])


def _rows_dense(x, launch, rows=None, blocks=None, warps=None):
    """``_rows`` with the scales' ``row_scales`` buffer as it is (what the operator returns)."""
    from prime_plugin_fp8.quant import FP8, padded

    rows, blocks, warps = rows or ROWS["rows"], blocks or ROWS["blocks"], warps or ROWS["warps"]
    m, k = x.shape
    kp = padded(k)
    q = torch.empty(m, kp, dtype=FP8, device=x.device)
    scale = row_scales(m, kp // BLOCK, x.device)
    if m and kp:
        grid = (-(-m // rows), -(-kp // (BLOCK * blocks)))
        launch(_kernels().rows)[grid](x, x.stride(0), x.stride(1), q, scale, 1, scale.stride(0), m, k, kp,
                                      BLOCK=BLOCK, ROWS=rows, BLOCKS=blocks, SOFT_ROUND=_interpreted(),
                                      num_warps=warps)
    return q, scale


def _blocks(w, launch, warps=4, transposed_store=None):
    """``blocks`` over ``w``; or, where ``w`` is the transpose of a row-major tensor (and
    ``transposed_store`` is not ``False``), over that tensor, its blocks stored transposed."""
    from prime_plugin_fp8.quant import FP8, padded

    if transposed_store is None:
        transposed_store = not w.is_contiguous() and w.t().is_contiguous()
    rows, columns = w.shape
    q = torch.empty(rows, padded(columns), dtype=FP8, device=w.device)
    scale = torch.empty(padded(rows) // BLOCK, padded(columns) // BLOCK, dtype=torch.float32, device=w.device)
    source = w.t() if transposed_store else w
    n, k = source.shape
    if w.numel():
        launch(_kernels().blocks)[(padded(n) // BLOCK, padded(k) // BLOCK)](
            source, source.stride(0), source.stride(1), q, scale, n, k, q.shape[1], BLOCK=BLOCK,
            SOFT_ROUND=_interpreted(), TRANSPOSE=transposed_store, num_warps=warps)
    return q, scale


ROWS_AND_COLUMNS = {"tiles": 1, "stages": 1, "warps": 4}
"""``rows_and_columns``' launch: 128 x 128 tiles a program, pipeline stages, warps. On an H200
(``kernels_bench.py quant``, stop 57) one tile and four warps was the fastest of 21 launches at
every block width: 1.07-1.10x eight warps (2.0-2.5 TB/s); more tiles a program, pipelined or
not, and sixteen warps were slower."""


def _rows_and_columns(x, launch, tiles=None, stages=None, warps=None):
    q, scale, qt, scale_t = _rows_and_columns_dense(x, launch, tiles, stages, warps)
    return q, scales_of(scale, x.shape[0]), qt, scales_of(scale_t, x.shape[1])


def _rows_and_columns_dense(x, launch, tiles=None, stages=None, warps=None):
    """``_rows_and_columns`` with the scales' ``row_scales`` buffers as they are."""
    from prime_plugin_fp8.quant import FP8, padded

    tiles = tiles or ROWS_AND_COLUMNS["tiles"]
    stages = stages or ROWS_AND_COLUMNS["stages"]
    warps = warps or ROWS_AND_COLUMNS["warps"]

    m, k = x.shape
    kp, mp = padded(k), padded(m)
    q = torch.empty(m, kp, dtype=FP8, device=x.device)
    scale = row_scales(m, kp // BLOCK, x.device)
    qt = torch.empty(k, mp, dtype=FP8, device=x.device)
    scale_t = row_scales(k, mp // BLOCK, x.device)
    if m and k:
        launch(_kernels().rows_and_columns)[(mp // BLOCK, -(-kp // (BLOCK * tiles)))](
            x, x.stride(0), x.stride(1), q, scale, 1, scale.stride(0), qt, scale_t, 1, scale_t.stride(0), m, k, kp, mp,
            BLOCK=BLOCK, SOFT_ROUND=_interpreted(), TILES=tiles, STAGES=stages, num_warps=warps)
    return q, scale, qt, scale_t


@triton_op("prime_fp8::quantize_rows", mutates_args=())
def _rows_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _rows_dense(x, wrap_triton)


@triton_op("prime_fp8::quantize_blocks", mutates_args=())
def _blocks_op(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _blocks(w, wrap_triton)


@triton_op("prime_fp8::quantize_rows_and_columns", mutates_args=())
def _rows_and_columns_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _rows_and_columns_dense(x, wrap_triton)


def _kernels():
    """The kernels' module, imported on first use (so that importing this one costs nothing,
    and a CPU test can switch the interpreter on first)."""
    from prime_plugin_fp8 import quant_kernels

    return quant_kernels


@functools.cache
def _interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` when first
    imported), which rounds to e4m3 in software: its own cast is not exact."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_kernels().rows, InterpretedFunction)
