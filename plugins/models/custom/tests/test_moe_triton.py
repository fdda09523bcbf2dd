"""``moe_triton``'s dispatch and combine against a float64 reference and against the
PyTorch path (``gather_rows``), forward and backward, on fresh random inputs: compiled on a
GPU, through Triton's interpreter elsewhere (``prime_core.testing.triton``)."""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from prime_core.testing.triton import device, interpreter_rerun, kernel_test  # noqa: E402
from prime_plugin_custom import moe_triton  # noqa: E402
from prime_plugin_custom.moe import gather_rows  # noqa: E402

DEVICE = device()
test_in_the_triton_interpreter = interpreter_rerun(__file__)
SHAPES = [(0, 16, 2), (1, 5, 1), (7, 33, 3), (13, 200, 8), (9, 3000, 8), (5, 64, 6)]  # (tokens, hidden, k)


def _routing(tokens, k, seed):
    """``inverse`` as the local dispatcher builds it: copies sorted by a random expert."""
    g = torch.Generator().manual_seed(seed)
    experts = torch.randint(0, 5, (tokens * k,), generator=g)
    order = torch.argsort(experts, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    weight = torch.rand(tokens, k, generator=g)
    return order.to(DEVICE), inverse.to(DEVICE), weight.to(DEVICE)


def _randn(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


def _tolerance(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_dispatch_copies_rows_exactly_and_sums_their_gradients(shape, dtype):
    tokens, hidden, k = shape
    order, inverse, _ = _routing(tokens, k, seed=hidden)
    x = _randn(tokens, hidden, dtype=dtype, seed=1).requires_grad_()
    out = moe_triton.dispatch(x, inverse, k)
    reference = gather_rows(x, order // k, inverse, k)
    assert out.dtype == dtype and torch.equal(out, reference), "a copy is exact"
    grad = _randn(tokens * k, hidden, dtype=dtype, seed=2)
    (got,) = torch.autograd.grad(out, x, grad)
    want = grad.double()[inverse].view(tokens, k, hidden).sum(dim=1)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, **_tolerance(dtype))


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_combine_matches_a_float64_reference_forward_and_backward(shape, dtype):
    tokens, hidden, k = shape
    order, inverse, weight = _routing(tokens, k, seed=hidden + 1)
    weight.requires_grad_()
    y = _randn(tokens * k, hidden, dtype=dtype, seed=3).requires_grad_()
    out = moe_triton.combine(y, inverse, weight)

    y64, w64 = y.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    want = (y64[inverse].view(tokens, k, hidden) * w64[..., None]).sum(dim=1)
    assert out.dtype == dtype and out.shape == (tokens, hidden)
    torch.testing.assert_close(out.double(), want, **_tolerance(dtype))

    grad = _randn(tokens, hidden, dtype=dtype, seed=4)
    got_y, got_w = torch.autograd.grad(out, (y, weight), grad)
    want_y, want_w = torch.autograd.grad(want, (y64, w64), grad.double())
    assert got_y.dtype == dtype and got_w.dtype == weight.dtype
    torch.testing.assert_close(got_y.double(), want_y, **_tolerance(dtype))
    # The router weight's gradient is a float32 dot product over the hidden features.
    torch.testing.assert_close(got_w.double(), want_w, atol=1e-4 * max(hidden, 1) ** 0.5, rtol=1e-4)

    # The PyTorch path agrees too (bfloat16: it rounds each weighted copy first).
    y_ref = gather_rows(y, inverse, order).view(tokens, k, hidden)
    ref = (y_ref * weight.to(dtype)[..., None]).sum(dim=1)
    torch.testing.assert_close(out.float(), ref.float(), **_tolerance(dtype))


@kernel_test
def test_combine_without_a_weight_gradient_skips_it():
    order, inverse, weight = _routing(6, 4, seed=0)
    y = _randn(24, 40, dtype=torch.float32, seed=5).requires_grad_()
    out = moe_triton.combine(y, inverse, weight)
    (got,) = torch.autograd.grad(out.sum(), y)
    torch.testing.assert_close(got, weight.reshape(-1)[order][:, None].expand(24, 40).contiguous())


@kernel_test
@pytest.mark.parametrize("launch", [(256, 0, 4), (256, 512, 4), (8192, 512, 8), (128, 16, 1)], ids=str)
def test_every_launch_shape_computes_the_same(launch, monkeypatch):
    """Tiles of a few features, programs covering part of a row (the router weight's gradient
    then summed from parts), or one tile a program: the same copies and sums."""
    tokens, hidden, k = 5, 1200, 8
    order, inverse, weight = _routing(tokens, k, seed=11)
    x = _randn(tokens, hidden, dtype=torch.bfloat16, seed=6)
    y = _randn(tokens * k, hidden, dtype=torch.bfloat16, seed=7)
    grad = _randn(tokens, hidden, dtype=torch.bfloat16, seed=8)

    def run():
        w = weight.clone().requires_grad_()
        y_ = y.clone().requires_grad_()
        out = moe_triton.combine(y_, inverse, w)
        return (moe_triton.dispatch(x, inverse, k), out, *torch.autograd.grad(out, (y_, w), grad))

    want = run()
    monkeypatch.setattr(moe_triton, "TILE", launch[0])
    monkeypatch.setattr(moe_triton, "SPAN", launch[1])
    monkeypatch.setattr(moe_triton, "WARPS", launch[2])
    got = run()
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2]), "weighted copies are exact"
    torch.testing.assert_close(got[1].float(), want[1].float(), atol=1e-2, rtol=1e-2)  # one bf16 rounding
    torch.testing.assert_close(got[3], want[3], atol=1e-4, rtol=1e-5)
