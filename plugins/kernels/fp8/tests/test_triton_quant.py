"""``triton_quant`` against ``quant``'s PyTorch quantisers, bit for bit, on fresh random inputs:
compiled on a GPU, through Triton's interpreter elsewhere (``prime_core.testing.triton``)."""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from prime_core.testing.triton import device, interpreter_rerun, kernel_test  # noqa: E402
from prime_plugin_fp8 import quant, triton_quant  # noqa: E402

DEVICE = device()
test_in_the_triton_interpreter = interpreter_rerun(__file__)


def _inputs(rows, cols, dtype, seed):
    # Magnitudes from 1e-6 to 1e3 across rows and a zero row: tiny gradients and outliers.
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-6, 3, rows)[:, None]
    x[rows // 2] = 0
    return x.to(dtype).to(DEVICE)


def _same(got, want):
    (q, s), (q_ref, s_ref) = got, want
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape and s.shape == s_ref.shape
    assert torch.equal(s.cpu(), s_ref.cpu())
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.cpu().view(torch.uint8))


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (33, 128), (70, 200), (130, 384)])
def test_rows_match_pytorch_bit_for_bit(shape, dtype):
    x = _inputs(*shape, dtype, seed=shape[0])
    _same(triton_quant.quantize_rows(x), quant.quantize_rows_torch(x))
    # A transposed view (the weight gradient's operands) is read in place.
    xt = _inputs(shape[1], shape[0], dtype, seed=7).t()
    _same(triton_quant.quantize_rows(xt), quant.quantize_rows_torch(xt))


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (5, 7), (128, 128), (200, 260), (300, 129)])
def test_blocks_match_pytorch_bit_for_bit(shape, dtype):
    w = _inputs(*shape, dtype, seed=shape[1])
    _same(triton_quant.quantize_blocks(w), quant.quantize_blocks_torch(w))
    wt = _inputs(shape[1], shape[0], dtype, seed=3).t()  # the input gradient's W.T
    _same(triton_quant.quantize_blocks(wt), quant.quantize_blocks_torch(wt))


@kernel_test
@pytest.mark.parametrize("shape", [(1, 1), (5, 7), (200, 260), (300, 129)])
def test_a_transposed_weight_is_read_along_its_rows_with_the_same_bits(shape):
    w = _inputs(*shape, torch.bfloat16, seed=sum(shape))
    want = triton_quant._blocks(w.t(), triton_quant._direct, transposed_store=False)  # read across rows
    _same(triton_quant._blocks(w.t(), triton_quant._direct), want)
    _same(triton_quant._blocks(w.t(), triton_quant._direct, transposed_store=True), want)


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (128, 128), (130, 384), (200, 129)])
def test_rows_and_columns_match_pytorch_bit_for_bit(shape, dtype):
    # Magnitudes spread along both dimensions, so a column's blocks differ from a row's.
    x = _inputs(*shape, dtype, seed=shape[0] + shape[1])
    x = x * torch.logspace(2, -4, shape[1], device=DEVICE).to(dtype)
    rows, columns = triton_quant.quantize_rows_and_columns(x)
    _same(rows, quant.quantize_rows_torch(x))
    _same(columns, quant.quantize_rows_torch(x.t()))
    # A transposed view (a gradient's layout) is read in place.
    xt = _inputs(shape[1], shape[0], dtype, seed=5).t()
    rows, columns = triton_quant.quantize_rows_and_columns(xt)
    _same(rows, quant.quantize_rows_torch(xt))
    _same(columns, quant.quantize_rows_torch(xt.t()))


@kernel_test
@pytest.mark.parametrize("tiles, stages, warps", [(2, 1, 4), (2, 2, 8), (4, 3, 8)])
def test_rows_and_columns_launches_give_the_same_bits(tiles, stages, warps):
    # Three 128-column blocks: with 2 or 4 tiles a program, the last program has tiles past the end.
    x = _inputs(200, 300, torch.bfloat16, seed=tiles + stages) * 3
    want = triton_quant._rows_and_columns(x, triton_quant._direct)
    got = triton_quant._rows_and_columns(x, triton_quant._direct, tiles=tiles, stages=stages, warps=warps)
    _same(got[:2], want[:2])
    _same(got[2:], want[2:])


@kernel_test
@pytest.mark.parametrize("rows, blocks, warps", [(32, 2, 4), (64, 4, 8), (16, 1, 2)])
def test_rows_launches_give_the_same_bits(rows, blocks, warps):
    # Three 128-column blocks and 200 rows: the last programs have rows and blocks past the end.
    x = _inputs(200, 300, torch.bfloat16, seed=rows + blocks) * 3
    want = triton_quant._rows(x, triton_quant._direct)
    _same(triton_quant._rows(x, triton_quant._direct, rows=rows, blocks=blocks, warps=warps), want)
    _same(triton_quant._rows(x.t().contiguous().t(), triton_quant._direct, rows=rows, blocks=blocks, warps=warps),
          want)


@kernel_test
@pytest.mark.parametrize("m", [1, 6, 128])
def test_row_scales_are_laid_out_as_the_gemms_read_them(m):
    # Column-major, each column 16-byte aligned: DeepGEMM takes them without a transposing kernel.
    x = _inputs(m, 300, torch.bfloat16, seed=m)
    (_, scale), (_, scale_t) = triton_quant.quantize_rows_and_columns(x)
    for s, rows in ((triton_quant.quantize_rows(x)[1], m), (scale, m), (scale_t, 300)):
        assert s.shape[0] == rows and s.stride(0) == 1 and s.stride(1) == -(-rows // 4) * 4


@kernel_test
def test_the_quantisers_use_the_kernels_on_their_device():
    x = _inputs(40, 300, torch.bfloat16, seed=1)
    _same(quant.quantize_rows(x), triton_quant.quantize_rows(x))
    _same(quant.quantize_blocks(x), triton_quant.quantize_blocks(x))
    _same(quant.quantize_blocks(x.t()), triton_quant.quantize_blocks(x.t()))
    for got, want in zip(quant.quantize_rows_and_columns(x), triton_quant.quantize_rows_and_columns(x), strict=True):
        _same(got, want)


@kernel_test
def test_every_binade_subnormals_and_ties_round_like_pytorch():
    # Within one block: magnitudes from 448 down past e4m3's smallest subnormal (2^-9), plus
    # exact ties between two e4m3 values (ties go to even) and both signs of zero.
    g = torch.Generator().manual_seed(11)
    mags = 448 * 2 ** torch.linspace(-20, 0, 128)
    signs = torch.where(torch.rand(128, generator=g) < 0.5, -1.0, 1.0)
    x = torch.stack([mags * signs, torch.randn(128, generator=g)])
    ties = torch.tensor([1.0625, 1.1875, 17.0, 19.0, 0.01171875, -1.0625, -0.0, 0.0, 448.0, -448.0])
    x[1, :ties.numel()] = ties
    x = torch.cat([x, x.flip(1)]).to(DEVICE)
    x[:2, 100] = 448.0  # the first rows' scale is then exactly 1: ties stay ties
    _same(triton_quant.quantize_rows(x), quant.quantize_rows_torch(x))
    _same(triton_quant.quantize_blocks(x), quant.quantize_blocks_torch(x))
