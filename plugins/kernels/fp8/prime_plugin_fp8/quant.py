"""Block-scaled FP8 quantisation (DeepSeek-V3's recipe), in plain PyTorch on any device.

- ``quantize_rows(x [M, K])``: one scale per 1×128 block along K (activations and
  gradients: a token's outlier only coarsens its own 128 values).
- ``quantize_rows_and_columns(x)``: ``quantize_rows`` of ``x`` and of ``x.T`` at once.
- ``quantize_blocks(w [N, K])``: one scale per 128×128 block (weights: the scales of ``W`` and
  of ``W.T`` are the same blocks, so either product can use them).

Values are ``torch.float8_e4m3fn``; scales are float32 and are *dequantisation* scales,
``x ≈ q.float() * scale``, with ``scale = amax(block) / 448`` so each block's largest
magnitude maps to e4m3's largest finite value. A block of zeros gets scale 1 (its values
quantise to 0 whatever the scale; 1 keeps the scale finite and non-zero). There is no lower
clamp on ``amax``: gradients can be tiny and must not be flushed to zero.

K that is not a multiple of 128 is padded with zeros up to ``Kp = 128 * ceil(K / 128)``:
``q`` is ``[M, Kp]`` and scales ``[M, Kp / 128]``. Zeros change no block's ``amax`` and add
nothing to a dot product, so a GEMM over ``Kp`` gives the product over ``K``. Rows (M, N) are
never padded; the last 128-row block of a weight is simply shorter.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from prime_plugin_fp8 import triton_quant

BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
TRITON = importlib.util.find_spec("triton") is not None
"""Whether CUDA tensors take the fused kernels (``triton_quant``); a constant, so that a graph
being compiled branches on it without a call dynamo would have to trace."""


def padded(k: int) -> int:
    """``k`` rounded up to a multiple of the 128 block."""
    return -(-k // BLOCK) * BLOCK


def _scales(amax: torch.Tensor) -> torch.Tensor:
    # Divided by a tensor, not a Python number: CUDA turns division by a number into a
    # multiplication by its reciprocal (a rounding away from the CPU's scales, and the block's
    # largest value would no longer land exactly on 448).
    scale = amax / torch.full_like(amax, FP8_MAX)
    # 0 for an all-zero block (or an amax so small that amax / 448 underflows): its values
    # quantise to 0 with any finite scale. NaN stays NaN, as it would in bf16.
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def _cast(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # Multiplied by the scale's reciprocal: one division per block where a division per value
    # made the fused kernels compute-bound (both round the reciprocal once, so the bits agree).
    # e4m3fn has no infinity: anything past 448 would become NaN, so the (rounding-level)
    # overshoot of amax * (1 / scale) is clamped.
    return (x * (torch.ones_like(scale) / scale)).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (any float dtype, any strides) -> ``(q [M, Kp] float8_e4m3fn, scale
    [M, Kp / 128] float32)``, one scale per 1×128 block along K. On a CUDA device with Triton,
    one fused kernel (``triton_quant``, the same bits); ``quantize_rows_torch`` elsewhere."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows takes a 2-D tensor, got shape {tuple(x.shape)}")
    if x.is_cuda and TRITON:
        return triton_quant.quantize_rows(x)
    return quantize_rows_torch(x)


def quantize_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows`` in PyTorch operations: the reference, and the path off CUDA."""
    m, k = x.shape
    kp = padded(k)
    # Row-major whatever the input's strides (a transposed view, an expanded gradient): the
    # GEMMs need it, and .to(memory_format=...) leaves a float32 input as it is.
    x = F.pad(x.float().contiguous(), (0, kp - k)).reshape(m, kp // BLOCK, BLOCK)
    scale = _scales(x.abs().amax(dim=-1))
    return _cast(x, scale[..., None]).view(m, kp), scale


def quantize_rows_and_columns(x: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor],
                                                          tuple[torch.Tensor, torch.Tensor]]:
    """``(quantize_rows(x), quantize_rows(x.T))``: both operands a linear's input (or its
    output's gradient) gives its GEMMs. On a CUDA device with Triton, one kernel reading ``x``
    once (``triton_quant``, the same bits); the two PyTorch quantisations elsewhere."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows_and_columns takes a 2-D tensor, got shape {tuple(x.shape)}")
    if x.is_cuda and TRITON:
        return triton_quant.quantize_rows_and_columns(x)
    return quantize_rows_torch(x), quantize_rows_torch(x.t())


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> ``(q [N, Kp] float8_e4m3fn, scale [ceil(N / 128), Kp / 128] float32)``,
    one scale per 128×128 block; fused like ``quantize_rows`` on a CUDA device."""
    if w.dim() != 2:
        raise ValueError(f"quantize_blocks takes a 2-D tensor, got shape {tuple(w.shape)}")
    if w.is_cuda and TRITON:
        return triton_quant.quantize_blocks(w)
    return quantize_blocks_torch(w)


def quantize_blocks_torch(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_blocks`` in PyTorch operations: the reference, and the path off CUDA."""
    n, k = w.shape
    kp, np_ = padded(k), padded(n)
    w = F.pad(w.float().contiguous(), (0, kp - k, 0, np_ - n))
    w = w.reshape(np_ // BLOCK, BLOCK, kp // BLOCK, BLOCK)
    scale = _scales(w.abs().amax(dim=(1, 3)))
    q = _cast(w, scale[:, None, :, None]).view(np_, kp)
    return q[:n], scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """float32 ``[M, k]`` from ``quantize_rows``' output (``k`` drops the padding)."""
    m, kp = q.shape
    x = (q.float().view(m, kp // BLOCK, BLOCK) * scale[..., None]).view(m, kp)
    return x if k is None else x[:, :k]


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """float32 ``[N, k]`` from ``quantize_blocks``' output (``k`` drops the padding)."""
    expanded = scale.repeat_interleave(BLOCK, dim=0)[: q.shape[0]].repeat_interleave(BLOCK, dim=1)
    x = q.float() * expanded
    return x if k is None else x[:, :k]
