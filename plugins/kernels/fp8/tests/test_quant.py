"""1×128 and 128×128 quantisation: shapes, padding, and the e4m3 rounding bound per element."""

import pytest
import torch

from prime_plugin_fp8.quant import FP8, dequantize_blocks, dequantize_rows, padded, quantize_blocks, quantize_rows


def _bound(x: torch.Tensor, scale_per_element: torch.Tensor) -> torch.Tensor:
    """e4m3 keeps 3 mantissa bits: a normal value (|x / scale| >= 2^-6) is off by at most
    2^-4 of itself, a subnormal one by at most half the smallest step, 2^-10 · scale. The
    1.0001 and 1e-30 absorb the float32 rounding of x / scale and q · scale."""
    return torch.maximum(x.abs() * 2.0**-4, scale_per_element * 2.0**-10) * 1.0001 + 1e-30


def _spread(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    # Magnitudes from 1e-8 to 1e4 across rows (gradients and outliers alike), with a zero row.
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-8, 4, rows)[:, None]
    x[rows // 2] = 0
    return x


@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (7, 128), (9, 200), (130, 384), (64, 1000)])
def test_rows_round_trip_within_the_e4m3_bound(shape):
    x = _spread(*shape)
    q, scale = quantize_rows(x)
    m, k = shape
    assert q.dtype == FP8 and q.shape == (m, padded(k)) and scale.dtype == torch.float32
    assert scale.shape == (m, padded(k) // 128)
    back = dequantize_rows(q, scale, k)
    per_element = scale.repeat_interleave(128, dim=1)[:, :k]
    assert ((back - x).abs() <= _bound(x, per_element)).all()
    assert (q[:, k:].float() == 0).all()  # the padding quantises to zero
    assert (scale[m // 2] == 1).all() and (back[m // 2] == 0).all()  # a zero block: scale 1, zeros back


@pytest.mark.parametrize("shape", [(1, 1), (1, 300), (5, 7), (128, 128), (200, 260), (300, 129)])
def test_blocks_round_trip_within_the_e4m3_bound(shape):
    x = _spread(*shape, seed=1)
    n, k = shape
    q, scale = quantize_blocks(x)
    assert q.dtype == FP8 and q.shape == (n, padded(k)) and q.is_contiguous()
    assert scale.shape == (-(-n // 128), padded(k) // 128)
    back = dequantize_blocks(q, scale, k)
    per_element = scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    assert ((back - x).abs() <= _bound(x, per_element)).all()


def test_each_block_keeps_its_own_scale_and_its_largest_value_exactly():
    w = torch.randn(256, 384, generator=torch.Generator().manual_seed(0))
    w[3, 5] = 1e6  # an outlier in block (0, 0) only
    q, scale = quantize_blocks(w)
    reference = w.abs().reshape(2, 128, 3, 128).amax(dim=(1, 3)) / 448
    torch.testing.assert_close(scale, reference, rtol=0, atol=0)
    back = dequantize_blocks(q, scale)
    assert back[3, 5] == pytest.approx(1e6, rel=1e-6)
    # Values 2^10 · 448 times below their block's largest flush to zero: in the outlier's block
    # nearly all the others do (|w| < 2.2); every other block keeps its own precision.
    assert (back[:128, :128] == 0).float().mean() > 0.9
    per_element = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert ((back - w).abs() <= _bound(w, per_element)).all()

    x = torch.randn(4, 256)
    q, scale = quantize_rows(x)
    amax_at = x.abs().reshape(4, 2, 128).argmax(-1)
    back = dequantize_rows(q, scale).reshape(4, 2, 128).gather(-1, amax_at[..., None])
    torch.testing.assert_close(back, x.reshape(4, 2, 128).gather(-1, amax_at[..., None]), rtol=1e-6, atol=0)


def test_inputs_of_any_float_dtype_and_strides():
    x = torch.randn(256, 200)
    for variant in (x.bfloat16(), x.double(), x.t(), x[:, ::2]):
        q, scale = quantize_rows(variant)
        assert ((dequantize_rows(q, scale, variant.shape[1]) - variant.float()).abs()
                <= _bound(variant.float(), scale.repeat_interleave(128, 1)[:, : variant.shape[1]])).all()
    q, scale = quantize_blocks(x.t())
    assert q.shape == (200, 256) and scale.shape == (2, 2)


def test_values_stay_finite_at_the_top_of_the_range():
    # amax / (amax / 448) can round just above 448, which e4m3fn (no infinity) would turn into NaN.
    x = torch.tensor([[3.0e38, -3.0e38, 1.0, 7.0e-3] * 32])
    q, _ = quantize_rows(x)
    assert not q.float().isnan().any() and q.float().abs().max() == 448


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_quantised_operands_are_row_major_whatever_the_input_strides(dtype):
    # cuBLASLt refuses FP8 operands that are neither row- nor column-major as it expects
    # ("Only multiplication of row-major and column-major matrices"): a transposed weight in
    # the input-gradient GEMM, a transposed activation in the weight-gradient GEMM, an
    # expanded gradient of a sum all reach the quantisers.
    inputs = [torch.randn(512, 256).to(dtype).t(), torch.ones(1, 1, dtype=dtype).expand(300, 256)]
    for x in inputs:
        for quantize in (quantize_rows, quantize_blocks):
            q, _ = quantize(x)
            assert q.is_contiguous(), (quantize.__name__, tuple(x.stride()))
