"""``fp8_linear`` on CPU: the emulated backend against float64, the torch backend's
per-K-chunk ``_scaled_mm`` path against the emulated one, and backend selection."""

import pytest
import torch

from prime_plugin_fp8 import gemm as gemms
from prime_plugin_fp8.linear import FP8Linear, fp8_linear, fp8_linears
from prime_plugin_fp8.quant import dequantize_blocks, dequantize_rows, quantize_blocks, quantize_rows

FP8_TOL = 0.05
"""Relative Frobenius error allowed against the float64 product. Measured on these shapes
(random normal data, fixed seeds): forward 2.1–4.2 % (4.2 for a single output value), input
gradient 2.4–3.6 %, weight gradient 2.2–4.1 % (0 for a single token: one value per block
quantises exactly)."""

SHAPES = [(1, 64, 1), (7, 200, 33), (130, 256, 128), (64, 300, 1), (3, 5, 17), (2, 3, 96, 40)]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def _operands(m, k, n, b_block, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 3
    return quantize_rows(x), (quantize_blocks(y) if b_block == 128 else quantize_rows(y))


def _assert_exact_product(got, a, b, b_block):
    """``got`` is ``A @ B.T`` of the dequantised operands up to float32 summation: off by at
    most 1e-5 of ``|A| @ |B|.T`` in every entry (the usual dot-product rounding bound, K·u)."""
    da = dequantize_rows(*a).double()
    db = (dequantize_blocks(*b) if b_block == 128 else dequantize_rows(*b)).double()
    assert got.shape == (da.shape[0], db.shape[0])
    assert ((got.double() - da @ db.T).abs() <= 1e-5 * (da.abs() @ db.abs().T)).all()


@pytest.mark.parametrize("b_block", [128, 1])
@pytest.mark.parametrize("mkn", [(1, 64, 1), (7, 200, 33), (130, 384, 257)])
def test_emulated_gemm_is_the_exact_product_of_the_quantised_operands(mkn, b_block):
    a, b = _operands(*mkn, b_block)
    got = gemms.gemm(a, b, b_block=b_block, out_dtype=torch.float32, backend="emulated")
    assert got.dtype == torch.float32
    _assert_exact_product(got, a, b, b_block)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_emulated_fp8_linear_tracks_float64_forward_and_backward(shape):
    *lead, k, n = shape
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*lead, k, generator=g, dtype=torch.float64)
    w = torch.randn(n, k, generator=g, dtype=torch.float64) / k**0.5
    b = torch.randn(n, generator=g, dtype=torch.float64)
    grad_y = torch.randn(*lead, n, generator=g, dtype=torch.float64)
    xs, ws, bs = (t.float().requires_grad_() for t in (x, w, b))

    y = fp8_linear(xs, ws, bs, backend="emulated")
    y.backward(grad_y.float())

    assert y.shape == (*lead, n) and y.dtype == torch.float32
    g2, x2 = grad_y.reshape(-1, n), x.reshape(-1, k)
    assert _rel(y, x @ w.T + b) < FP8_TOL
    assert _rel(xs.grad, grad_y @ w) < FP8_TOL
    assert _rel(ws.grad, g2.T @ x2) < FP8_TOL
    assert _rel(bs.grad, g2.sum(0)) < 1e-6  # the bias stays in high precision


def test_high_precision_weight_gradient_on_request():
    x, w = torch.randn(37, 130), torch.randn(20, 130)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    grad_y = torch.randn(37, 20)
    fp8_linear(xs, ws, backend="emulated", fp8_wgrad=False).backward(grad_y)
    torch.testing.assert_close(ws.grad, grad_y.T @ x)
    assert _rel(xs.grad, (grad_y @ w).double()) < FP8_TOL


def test_autocast_does_not_round_the_gemms():
    x, w = torch.randn(9, 200), torch.randn(24, 200)
    plain = fp8_linear(x, w, backend="emulated")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = fp8_linear(x, w, backend="emulated")
    assert autocast.dtype == torch.float32 and torch.equal(autocast, plain)


def test_frozen_weight_gets_no_gradient_and_empty_batches_work():
    w = torch.randn(8, 300)
    x = torch.randn(5, 300, requires_grad=True)
    fp8_linear(x, w, backend="emulated").sum().backward()
    assert x.grad is not None and _rel(x.grad, torch.ones(5, 8).double() @ w.double()) < FP8_TOL

    ws = w.clone().requires_grad_()
    empty = torch.zeros(0, 300, requires_grad=True)
    y = fp8_linear(empty, ws, backend="emulated")
    assert y.shape == (0, 8)
    y.sum().backward()
    assert (ws.grad == 0).all() and empty.grad.shape == (0, 300)


def test_each_gradient_alone_is_the_one_computed_beside_the_other_and_x_is_kept_in_fp8():
    x, w, grad_y = torch.randn(37, 200), torch.randn(24, 200) / 14, torch.randn(37, 24)

    def run(x_grad: bool, w_grad: bool):
        xs, ws = x.clone().requires_grad_(x_grad), w.clone().requires_grad_(w_grad)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = fp8_linear(xs, ws, backend="emulated")
        y.backward(grad_y)
        return xs.grad, ws.grad, [(tuple(t.shape), t.dtype) for t in saved]

    grad_x, grad_w, saved = run(True, True)
    assert torch.equal(run(True, False)[0], grad_x) and torch.equal(run(False, True)[1], grad_w)
    # x.T quantised along the 37 tokens (padded to 128) and its scales, then W: no float32 x.
    assert saved == [((200, 128), torch.float8_e4m3fn), ((200, 1), torch.float32), ((24, 200), torch.float32)]
    assert run(False, True)[2] == saved[:2] and run(True, False)[2] == saved[2:]


@pytest.mark.parametrize("fp8_wgrad", [True, False], ids=["fp8_wgrad", "wgrad_high"])
def test_linears_of_one_input_as_a_group_are_the_separate_linears(fp8_wgrad):
    """q, k, v (biases on two, one output unused by the loss) as one group: the same outputs
    and gradients as three calls, with one quantisation of x saved (not three)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 37, 200, generator=g)
    weights = [torch.randn(n, 200, generator=g) / 14 for n in (256, 128, 128)]
    biases = [torch.randn(256, generator=g), None, torch.randn(128, generator=g)]
    grads = [torch.randn(2, 37, n, generator=g) for n in (256, 128)]

    def run(grouped: bool):
        xs = x.clone().requires_grad_()
        ws = [w.clone().requires_grad_() for w in weights]
        bs = [None if b is None else b.clone().requires_grad_() for b in biases]
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            if grouped:
                outs = fp8_linears(xs, ws, bs, backend="emulated", fp8_wgrad=fp8_wgrad)
            else:
                outs = [fp8_linear(xs, w, b, backend="emulated", fp8_wgrad=fp8_wgrad)
                        for w, b in zip(ws, bs, strict=True)]
        sum((o * gy).sum() for o, gy in zip(outs[:2], grads, strict=True)).backward()  # v's output unused
        # A group's unused output still gives its weight and bias gradients: zeros, where alone
        # they get none.
        params = [*ws, bs[0], bs[2]]
        return [*outs, xs.grad, *(torch.zeros_like(p) if p.grad is None else p.grad for p in params)], saved

    (grouped, saved), (separate, saved_separately) = run(True), run(False)
    # The same values up to float32's summation order: the group's input gradient is one matmul
    # over the concatenated dy, the separate ones a sum of three, and a BLAS may block a wider
    # matmul differently (2e-6 apart on one CPU, bit for bit on another). Nothing here is
    # quantised after a matmul, so no FP8 rounding can tip.
    for got, want in zip(grouped, separate, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(saved) == len(saved_separately) - 2 * (2 if fp8_wgrad else 1)


def test_a_group_needs_whole_weight_blocks():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="multiples of 128, got \\[128, 64\\]"):
        fp8_linears(x, [torch.randn(128, 64), torch.randn(64, 64)], backend="emulated")
    linears = [FP8Linear(torch.nn.Linear(64, n), backend="emulated") for n in (128, 64)]
    assert FP8Linear.forward_group(x, linears) is None
    linears[1] = FP8Linear(torch.nn.Linear(64, 128), backend="emulated")
    assert len(FP8Linear.forward_group(x, linears)) == 2
    linears[1].register_forward_hook(lambda *_: None)  # a hook runs only when called alone
    assert FP8Linear.forward_group(x, linears) is None


def test_fp8_linear_module_holds_the_original_parameters():
    linear = torch.nn.Linear(300, 33)
    module = FP8Linear(linear, backend="emulated")
    assert module.weight is linear.weight and module.bias is linear.bias
    assert isinstance(module, torch.nn.Linear) and dict(module.state_dict()).keys() == {"weight", "bias"}
    assert "fp8=emulated" in repr(module)
    x = torch.randn(4, 300)
    assert _rel(module(x), linear(x).double()) < FP8_TOL
    no_bias = FP8Linear(torch.nn.Linear(300, 33, bias=False))
    assert no_bias.bias is None and list(no_bias.state_dict()) == ["weight"]


@pytest.mark.parametrize("b_block", [128, 1])
@pytest.mark.parametrize("mkn", [(1, 64, 1), (7, 200, 33), (130, 384, 257), (64, 300, 16)])
def test_torch_chunked_scaled_mm_matches_emulated(mkn, b_block):
    """The ``torch`` backend's fallback, one row-wise ``torch._scaled_mm`` per K chunk, runs on
    CPU (tensor-/row-wise float8_e4m3fn scaling does in torch 2.13): every product of a linear
    (forward and input gradient: 128×128 weights; weight gradient: 1×128 both)."""
    a, b = _operands(*mkn, b_block, seed=3)
    try:
        got = gemms.torch_gemm(a, b, b_block=b_block, out_dtype=torch.float32, mode="chunked")
    except RuntimeError as exc:
        if "per-tensor scaling for CPU" not in str(exc):
            raise
        pytest.skip(f"torch {torch.__version__} scales _scaled_mm per tensor only on a CPU (2.13 scales per row)")
    _assert_exact_product(got, a, b, b_block)
    _assert_exact_product(gemms.emulated_gemm(a, b, b_block=b_block, out_dtype=torch.float32), a, b, b_block)
    assert gemms.torch_gemm(a, b, b_block=b_block, out_dtype=torch.bfloat16, mode="chunked").dtype == torch.bfloat16


@pytest.mark.parametrize("rows", [1, 5, 256])
@pytest.mark.parametrize("k_blocks", [1, 3, 4, 5])
def test_blockwise_scales_have_the_layouts_scaled_mm_checks(rows, k_blocks):
    a_scale = torch.rand(rows, k_blocks)
    w_scale = torch.rand(3, k_blocks)  # a weight of 257..384 rows
    sa, sb = gemms.blockwise_scales(a_scale, w_scale, 128)
    l4 = -(-k_blocks // 4) * 4
    assert sa.shape == (rows, k_blocks) and sa.stride(0) == 1 and (sa.stride(1) == rows or k_blocks == 1)
    assert torch.equal(sa, a_scale)
    assert sb.shape == (l4, 3) and sb.stride() == (1, l4)
    assert torch.equal(sb[:k_blocks], w_scale.T) and (sb[k_blocks:] == 0).all()
    sa, sb = gemms.blockwise_scales(a_scale, a_scale, 1)
    assert sb.shape == (rows, k_blocks) and sb.stride(0) == 1 and torch.equal(sb, a_scale)


def test_backend_names_and_devices():
    cpu = torch.device("cpu")
    assert gemms.resolve("auto", cpu) == "emulated" and gemms.resolve("emulated", cpu) == "emulated"
    for name in ("torch", "deep_gemm"):
        with pytest.raises(RuntimeError, match="needs CUDA tensors"):
            gemms.resolve(name, cpu)
    with pytest.raises(ValueError, match="unknown FP8 backend 'fp4'"):
        gemms.resolve("fp4", cpu)
    x = torch.randn(3, 130)
    torch.testing.assert_close(fp8_linear(x, torch.eye(130)[:7], backend="auto"),
                               fp8_linear(x, torch.eye(130)[:7], backend="emulated"))


def test_compiles_into_one_graph_of_custom_gemm_operators_with_the_same_results():
    # The GEMMs are custom operators, opaque to the compiler: fullgraph fails on any graph
    # break, and the graphs hold one operator per GEMM, not what it does inside (the backends'
    # dispatch, which broke the graph at every linear). The quantisers around them are traced
    # (on CUDA Triton operators that Inductor launches; here the PyTorch reference).
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch.manual_seed(0)
    x = torch.randn(3, 5, 200, requires_grad=True)
    weight = (torch.randn(130, 200) / 14).requires_grad_()
    bias = torch.randn(130, requires_grad=True)
    dy = torch.randn(3, 5, 130)

    def run(fn):
        out = fn(x, weight, bias)
        grads = torch.autograd.grad((out * dy).sum(), (x, weight, bias))
        return out, *grads

    eager = run(lambda *a: fp8_linear(*a, backend="emulated"))
    backend = aot_autograd(fw_compiler=keep, bw_compiler=keep)
    compiled = run(torch.compile(lambda *a: fp8_linear(*a, backend="emulated"), fullgraph=True, backend=backend))
    for got, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    gemms = [[str(node.target) for node in gm.graph.nodes if str(node.target).startswith("prime_fp8")]
             for gm in graphs]
    assert gemms == [["prime_fp8.gemm.default"], ["prime_fp8.gemm.default"] * 2], gemms  # forward, backward

    # A group (q, k, v) compiles the same way: one GEMM of each kind for the three.
    graphs.clear()
    weights = [(torch.randn(n, 200) / 14).requires_grad_() for n in (256, 128, 128)]

    def group(x, *weights):
        q, k, v = fp8_linears(x, weights, [bias[:128].repeat(2), None, None], backend="emulated")
        return q.sum(-1) + k.sum(-1) * v.sum(-1)

    def run_group(fn):
        out = fn(x, *weights)
        return out, *torch.autograd.grad(out.sum(), (x, *weights))

    compiled = run_group(torch.compile(group, fullgraph=True, backend=backend))
    for got, want in zip(compiled, run_group(group), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    gemms = [[str(node.target) for node in gm.graph.nodes if str(node.target).startswith("prime_fp8")]
             for gm in graphs]
    assert gemms == [["prime_fp8.gemm.default"], ["prime_fp8.gemm.default"] * 2], gemms
