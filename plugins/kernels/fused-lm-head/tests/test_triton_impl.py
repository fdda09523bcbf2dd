"""``lm_head:fused_triton`` against the float64 reference and the PyTorch implementation:
compiled on a GPU, through Triton's interpreter elsewhere (``prime_core.testing.triton``)."""

import pytest
import torch

from prime_core.plugins import PluginManager

triton = pytest.importorskip("triton", reason="triton is not installed")

from prime_core.testing.triton import device, interpreter_rerun, kernel_test  # noqa: E402
from prime_plugin_fused_lm_head import triton_impl  # noqa: E402
from prime_plugin_fused_lm_head.reference import check_against_reference, make_inputs  # noqa: E402
from prime_plugin_fused_lm_head.torch_impl import fused_logprobs as torch_logprobs  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = device()
test_in_the_triton_interpreter = interpreter_rerun(__file__)


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("n", "vocab", "width", "token_chunk", "vocab_chunk"), [
    (1, 11, 8, 1, None),
    # Five vocabulary slices, the last one short (few: each is one more launch of both kernels
    # per token chunk, about 13 ms in the interpreter; 43 slices of 7 took 7 s a dtype of 36).
    (7, 300, 32, 3, 64),
    (16, 4500, 16, 6, None),   # more than one BLOCK of columns per row
    (9, 4300, 8, "auto", 2100),  # vocabulary slices that straddle blocks
    (33, 4500, 16, "auto", None),  # the logits kept for the backward and worked in place
])
def test_matches_reference(n, vocab, width, token_chunk, vocab_chunk, dtype):
    for per_token in (False, True):
        check_against_reference(triton_impl.fused_logprobs, n, vocab, width, dtype, per_token, token_chunk,
                                vocab_chunk, seed=n + vocab, device=DEVICE)


@kernel_test
def test_backward_tiles_in_either_order(monkeypatch):
    from prime_plugin_fused_lm_head import chunking

    monkeypatch.setattr(chunking, "VOCAB_SLICE", 700)
    # The vocabulary outside (slices straddling the kernels' blocks), then the tokens outside
    # (more tokens than vocabulary: three token tiles by three vocabulary slices, each last one
    # short; small, since the interpreter's time grows with tokens × slices).
    for n, vocab, token_chunk, vocab_chunk in ((30, 2500, 4, None), (30, 2500, 4, 2100), (60, 50, 25, 20)):
        check_against_reference(triton_impl.fused_logprobs, n, vocab, 8, torch.bfloat16, True, token_chunk,
                                vocab_chunk, seed=n, device=DEVICE)


@kernel_test
def test_kept_logits_serve_one_backward():
    hidden, weight, targets, temperature, upstream = make_inputs(6, 50, 8, torch.float32, True, seed=2)
    hidden, weight = (t.detach().to(DEVICE).requires_grad_() for t in (hidden, weight))
    targets, temperature, upstream = targets.to(DEVICE), temperature.to(DEVICE), upstream.to(DEVICE)
    logp, _ = triton_impl.fused_logprobs(hidden, weight, targets, temperature, token_chunk="auto")
    assert any(t is not None and t.shape == (6, 50) for t in logp.grad_fn.saved_tensors)
    torch.autograd.grad((logp * upstream).sum(), (hidden, weight), retain_graph=True)
    # Their gradient was written over them: autograd refuses a second pass instead of using it.
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad((logp * upstream).sum(), (hidden, weight))


@kernel_test
def test_large_logits_stay_exact():
    check_against_reference(triton_impl.fused_logprobs, 10, 3000, 16, torch.float32, True, 4, 1000,
                            logit_scale=200.0, loosen=10.0, device=DEVICE)


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_equals_the_pytorch_implementation(dtype):
    hidden, weight, targets, temperature, upstream = make_inputs(12, 3000, 16, dtype, True, seed=9)
    hidden, weight = (t.detach().to(DEVICE).requires_grad_() for t in (hidden, weight))
    targets, temperature, upstream = targets.to(DEVICE), temperature.to(DEVICE), upstream.to(DEVICE)
    results = []
    for impl in (triton_impl.fused_logprobs, torch_logprobs):
        logp, entropy = impl(hidden, weight, targets, temperature, token_chunk=5, vocab_chunk=None)
        results.append((logp, entropy, *torch.autograd.grad((logp * upstream).sum(), (hidden, weight))))
    # The same logits in the same dtype, the same float32 softmax: only the order of the sums differs.
    for got, ref in zip(*results, strict=True):
        scale = max(1.0, ref.float().abs().max().item())
        limit = 1e-5 if dtype == torch.float32 else 2 ** -7
        assert (got.float() - ref.float()).abs().max().item() <= limit * scale


@kernel_test
def test_no_tokens_and_no_entropy():
    hidden = torch.zeros(0, 8, device=DEVICE, requires_grad=True)
    weight = torch.randn(11, 8, device=DEVICE, requires_grad=True)
    logp, entropy = triton_impl.fused_logprobs(hidden, weight, torch.zeros(0, dtype=torch.int64, device=DEVICE),
                                               1.0, token_chunk="auto")
    assert logp.shape == entropy.shape == (0,)
    hidden, weight, targets, _, _ = make_inputs(6, 50, 8, torch.float32, False, seed=1)
    args = (hidden.to(DEVICE), weight.to(DEVICE), targets.to(DEVICE), 0.7)
    with_entropy = triton_impl.fused_logprobs(*args, token_chunk=4)[0]
    logp_only, none = triton_impl.fused_logprobs(*args, token_chunk=4, with_entropy=False)
    assert none is None
    torch.testing.assert_close(logp_only, with_entropy, rtol=0, atol=0)


@kernel_test
def test_float64_is_refused_with_the_alternative():
    hidden, weight = torch.randn(3, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="lm_head:fused_torch"):
        triton_impl.fused_logprobs(hidden, weight, torch.zeros(3, dtype=torch.int64), token_chunk=2)


def test_fused_picks_triton_only_for_cuda_tensors(monkeypatch):
    manager = PluginManager(autoload=True, disabled=()).load()
    fused = manager.select("kernels", "lm_head:fused").impl
    calls = []
    monkeypatch.setattr(triton_impl, "fused_logprobs", lambda *a, **k: calls.append("triton") or (None, None))
    hidden, weight = torch.randn(3, 4), torch.randn(5, 4)
    fused(hidden, weight, torch.zeros(3, dtype=torch.int64), token_chunk=2)
    assert calls == []  # CPU tensors: the PyTorch implementation
    if CUDA:
        fused(hidden.cuda(), weight.cuda(), torch.zeros(3, dtype=torch.int64, device="cuda"), token_chunk=2)
        assert calls == ["triton"]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: the compiled kernels at a real vocabulary size")
def test_real_vocabulary_on_gpu():
    # Qwen3's vocabulary and a 2k-token row: what the trainer runs, compiled.
    check_against_reference(triton_impl.fused_logprobs, 2048, 151936, 256, torch.bfloat16, True, "auto", None,
                            seed=3, device="cuda")
