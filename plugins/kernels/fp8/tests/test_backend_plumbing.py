"""The GPU backends' argument plumbing, run on CPU against stand-ins for
``torch.nn.functional.scaled_mm`` and ``deep_gemm.fp8_gemm_nt`` that enforce the shapes,
strides, dtypes and recipes those APIs document (PyTorch's checks in ScaledBlas.cpp, DeepGEMM's
``fp8_gemm_nt`` contract) and then compute the product from the dequantised operands. This
checks our padding, layouts and slicing; that the real kernels agree is ``test_gpu.py``'s job."""

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from prime_plugin_fp8 import gemm
from prime_plugin_fp8.linear import fp8_linear
from prime_plugin_fp8.quant import quantize_blocks, quantize_rows

FP8_TOL = 0.05


def _ceil(a, b):
    return -(-a // b)


def _dequant_1x128(q, scale):
    return q.float() * scale.repeat_interleave(128, dim=1)[:, : q.shape[1]]


def _dequant_128x128(q, scale):
    return q.float() * scale.repeat_interleave(128, 0)[: q.shape[0]].repeat_interleave(128, 1)[:, : q.shape[1]]


def fake_scaled_mm(mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, output_dtype):
    m, k = mat_a.shape
    n = mat_b.shape[1]
    kb = _ceil(k, 128)
    assert mat_a.dtype == mat_b.dtype == torch.float8_e4m3fn
    assert mat_a.stride(1) == 1 and mat_b.stride(0) == 1, "A row-major, B column-major"
    assert k % 16 == 0 and n % 16 == 0, "cuBLASLt: K and N multiples of 16"
    assert output_dtype in (torch.bfloat16, torch.float32)
    assert scale_recipe_a == F.ScalingType.BlockWise1x128
    assert scale_a.dtype == torch.float32 and scale_a.shape == (m, kb)
    assert scale_a.stride(0) == 1 and (scale_a.stride(1) == m or kb == 1), scale_a.stride()
    a = _dequant_1x128(mat_a, scale_a)
    bt = mat_b.t()  # [N, K]
    if scale_recipe_b == F.ScalingType.BlockWise128x128:
        l4 = _ceil(kb, 4) * 4
        assert scale_b.shape == (l4, _ceil(n, 128)) and scale_b.stride() == (1, l4), (scale_b.shape, scale_b.stride())
        b = _dequant_128x128(bt, scale_b[:kb].t())
    else:
        assert scale_recipe_b == F.ScalingType.BlockWise1x128
        assert scale_b.shape == (n, kb) and scale_b.stride(0) == 1 and (scale_b.stride(1) == n or kb == 1)
        b = _dequant_1x128(bt, scale_b)
    return (a.double() @ b.double().T).to(output_dtype)


def fake_fp8_gemm_nt(a, b, d, c=None, recipe=None, compiled_dims="nk", disable_ue8m0_cast=False):
    (qa, sa), (qb, sb) = a, b
    m, k = qa.shape
    n = qb.shape[0]
    assert qa.is_contiguous() and qb.is_contiguous() and qb.shape[1] == k, "both K-major"
    assert k % 128 == 0 and n % 16 == 0 and disable_ue8m0_cast
    assert sa.dtype == sb.dtype == torch.float32 and sa.shape == (m, k // 128)
    assert d.is_contiguous() and d.shape == (m, n)
    if recipe == (1, 128, 128):
        assert sb.shape == (_ceil(n, 128), k // 128) and d.dtype == torch.bfloat16 and c is None
        b_deq = _dequant_128x128(qb, sb)
    else:
        assert recipe == (1, 1, 128) and sb.shape == (n, k // 128)
        assert d.dtype == torch.float32 and c is d, "SM90 1D1D: float32 D accumulating C"
        # For fewer rows DeepGEMM picked a block its 1D1D kernel refuses to compile (an H200, m = 1).
        assert m % 64 == 0, "SM90 1D1D: whole 64-row WGMMA blocks"
        b_deq = _dequant_1x128(qb, sb)
    product = _dequant_1x128(qa, sa).double() @ b_deq.double().T
    d.copy_((product + (c.double() if c is not None else 0)).to(d.dtype))


@pytest.fixture
def fakes(monkeypatch):
    monkeypatch.setattr(F, "scaled_mm", fake_scaled_mm, raising=False)
    monkeypatch.setitem(sys.modules, "deep_gemm", types.SimpleNamespace(fp8_gemm_nt=fake_fp8_gemm_nt))
    monkeypatch.setitem(gemm._torch_modes, "cpu", "blockwise")


def _rel(got, want) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.parametrize("backend", ["torch", "deep_gemm"])
@pytest.mark.parametrize("shape", [(1, 64, 1), (7, 200, 33), (130, 384, 257), (40, 1000, 130)], ids=str)
def test_linear_through_each_gpu_backend_matches_emulated(fakes, monkeypatch, backend, shape):
    m, k, n = shape
    g = torch.Generator().manual_seed(sum(shape))
    x, w, b, grad_y = (torch.randn(*s, generator=g) for s in ((m, k), (n, k), (n,), (m, n)))

    def run(name):
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
        y = fp8_linear(xs, ws, bs, backend=name)
        y.backward(grad_y)
        return y, xs.grad, ws.grad, bs.grad

    want = run("emulated")
    monkeypatch.setattr(gemm, "resolve", lambda name, device: backend)
    got = run(backend)
    for label, a, r in zip(("y", "grad_x", "grad_w", "grad_b"), got, want, strict=True):
        assert a.shape == r.shape and a.dtype == r.dtype, label
        # deep_gemm's 1D2D kernel writes bf16: its y and grad_x carry bf16 rounding.
        tol = 1e-2 if backend == "deep_gemm" and label in ("y", "grad_x") else 1e-6
        assert _rel(a, r) < tol, (label, _rel(a, r))
    assert _rel(got[0], x.double() @ w.double().T + b.double()) < FP8_TOL


def test_torch_backend_falls_back_to_chunks_when_pytorch_refuses_the_recipes(fakes, monkeypatch):
    def refuse(*args, **kwargs):
        raise NotImplementedError("DeepSeek style (1x128, 128x128) scaling requires cublasLt >= 12.9")

    monkeypatch.setattr(F, "scaled_mm", refuse)
    monkeypatch.setitem(gemm._torch_fallbacks, "cpu", None)
    a, b = quantize_rows(torch.randn(5, 300)), quantize_blocks(torch.randn(20, 300))
    got = gemm.torch_gemm(a, b, b_block=128, out_dtype=torch.float32)
    assert gemm.torch_mode(torch.device("cpu")) == "chunked" and "cublasLt" in gemm._torch_fallbacks["cpu"]
    assert _rel(got, gemm.emulated_gemm(a, b, b_block=128, out_dtype=torch.float32)) < 1e-6


def test_deep_gemm_says_once_where_its_compiled_kernels_are_kept(fakes, monkeypatch, tmp_path, caplog):
    """DeepGEMM compiles a kernel per layout at first use (an H200's RL rows: steps of 8-32 s on
    a fresh cache, stop 72): the first GEMM names the cache a user should keep."""
    monkeypatch.setenv("DG_JIT_CACHE_DIR", str(tmp_path / "dg"))
    gemm.deep_gemm_jit_note.cache_clear()
    x, w = torch.randn(16, 128), torch.randn(32, 128)
    with caplog.at_level("INFO", logger="prime.fp8"):
        for _ in range(2):
            gemm.deep_gemm_gemm(quantize_rows(x), quantize_blocks(w), b_block=128, out_dtype=torch.float32)
    notes = [r.getMessage() for r in caplog.records if "DG_JIT_CACHE_DIR" in r.getMessage()]
    assert len(notes) == 1 and str(tmp_path / "dg") in notes[0]
    gemm.deep_gemm_jit_note.cache_clear()
