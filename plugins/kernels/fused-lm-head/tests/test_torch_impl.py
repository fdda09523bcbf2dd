"""``fused_logprobs`` against the float64 eager reference (full logits, log_softmax, gather),
forward and backward, across shapes, dtypes, chunkings and temperatures (tolerances:
``reference.check_against_reference``).
"""

import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from prime_plugin_fused_lm_head.reference import assert_near, check_against_reference, make_inputs, reference_logprobs
from prime_plugin_fused_lm_head.torch_impl import fused_logprobs

SHAPES = list(itertools.product((1, 7, 64, 130), (11, 300, 1000), (8, 32)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("n", "vocab", "width"), SHAPES)
def test_matches_reference_across_shapes(n, vocab, width, dtype):
    # Chunks that divide neither N nor V, a few of each (one token chunk larger than N when N = 1).
    index = SHAPES.index((n, vocab, width))
    check_against_reference(fused_logprobs, n, vocab, width, dtype, per_token=index % 2 == 1, token_chunk=n // 4 + 2,
                            vocab_chunk=vocab // 3 + 1, seed=index)


@pytest.mark.parametrize("per_token", [False, True], ids=["scalar_t", "per_token_t"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("vocab_chunk", [None, 7, "V"])
@pytest.mark.parametrize("token_chunk", [1, 3, "N", "N+5"])
@pytest.mark.parametrize(("n", "vocab", "width"), [(7, 300, 32), (64, 11, 8)])
def test_every_chunking_matches_reference(n, vocab, width, token_chunk, vocab_chunk, dtype, per_token):
    token_chunk = {"N": n, "N+5": n + 5}.get(token_chunk, token_chunk)
    vocab_chunk = vocab if vocab_chunk == "V" else vocab_chunk
    check_against_reference(fused_logprobs, n, vocab, width, dtype, per_token, token_chunk, vocab_chunk, seed=n + vocab)


@pytest.mark.parametrize("vocab_chunk", [None, 7])
def test_large_logits_stay_exact(vocab_chunk):
    # Logits in the hundreds: exp() of them overflows float32 unless shifted, and vocabulary
    # chunks with very different maxima must merge. Rounding the float32 logits alone costs
    # ~3e-5 there (measured worst: 1.6x the plain 1e-5 tolerance), hence 10x.
    check_against_reference(fused_logprobs, 20, 300, 16, torch.float32, True, 6, vocab_chunk, logit_scale=200.0,
                            loosen=10.0)


def test_float64_passes_gradcheck():
    hidden, weight, targets, temperature, _ = make_inputs(5, 9, 4, torch.float64, True, seed=3)
    torch.autograd.gradcheck(
        lambda h, w: fused_logprobs(h, w, targets, temperature, token_chunk=2, vocab_chunk=4)[0], (hidden, weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_no_tokens(dtype):
    hidden = torch.zeros(0, 8, dtype=dtype, requires_grad=True)
    weight = torch.randn(11, 8, dtype=dtype, requires_grad=True)
    targets = torch.zeros(0, dtype=torch.int64)
    for temperature in (1.0, torch.zeros(0)):
        logp, entropy = fused_logprobs(hidden, weight, targets, temperature, token_chunk="auto", vocab_chunk=4)
        assert logp.shape == entropy.shape == (0,)
        grad_hidden, grad_weight = torch.autograd.grad(logp.sum(), (hidden, weight))
        assert grad_hidden.shape == (0, 8) and grad_hidden.dtype == dtype
        assert grad_weight.dtype == dtype and not grad_weight.any()


def test_non_contiguous_inputs_and_tensor_temperatures():
    hidden, weight, targets, temperature, upstream = make_inputs(9, 40, 6, torch.float32, True, seed=5)
    hidden_t = hidden.detach().T.contiguous().requires_grad_()  # [H, N]: hidden_t.T is a strided view
    weight_wide = torch.randn(40, 12).requires_grad_()
    with torch.no_grad():
        weight_wide[:, ::2] = weight
    strided_weight = weight_wide[:, ::2]
    assert not hidden_t.T.is_contiguous() and not strided_weight.is_contiguous()
    logp, entropy = fused_logprobs(hidden_t.T, strided_weight, targets, temperature, token_chunk=4, vocab_chunk=9)
    grads = torch.autograd.grad((logp * upstream).sum(), (hidden_t, weight_wide))
    ref_logp, ref_entropy = reference_logprobs(hidden_t.T, strided_weight, targets, temperature)
    ref_grads = torch.autograd.grad((ref_logp * upstream.double()).sum(), (hidden_t, weight_wide))
    assert_near(logp, ref_logp, torch.float32, "logp")
    assert_near(entropy, ref_entropy, torch.float32, "entropy")
    for got, ref in zip(grads, ref_grads, strict=True):
        assert_near(got, ref, torch.float32, "grad")
    assert not grads[1][:, 1::2].any()

    # A one-element tensor is one temperature for every token; a float equals it.
    one = fused_logprobs(hidden, weight, targets, torch.tensor(0.8), token_chunk=4)[0]
    torch.testing.assert_close(one, fused_logprobs(hidden, weight, targets, 0.8, token_chunk=4)[0])


def test_tied_embedding_gets_both_gradients():
    generator = torch.Generator().manual_seed(7)
    embedding = torch.randn(50, 16, generator=generator).requires_grad_()
    input_ids = torch.randint(0, 50, (12,), generator=generator)
    mix = torch.randn(16, 16, generator=generator) / 4

    def head(fn):
        hidden = torch.tanh(embedding[input_ids] @ mix)
        logp, _ = fn(hidden, embedding, torch.roll(input_ids, -1))
        return torch.autograd.grad(logp.sum(), embedding)[0]

    got = head(lambda h, w, t: fused_logprobs(h, w, t, 1.3, token_chunk=5, vocab_chunk=16))
    expected = head(lambda h, w, t: reference_logprobs(h, w, t, 1.3))
    assert_near(got, expected, torch.float32, "grad of the tied embedding")


def test_entropy_is_optional_and_not_differentiable():
    hidden, weight, targets, temperature, _ = make_inputs(6, 20, 8, torch.float32, False, seed=2)
    logp, entropy = fused_logprobs(hidden, weight, targets, temperature, token_chunk=4)
    assert logp.requires_grad and not entropy.requires_grad
    logp_only, none = fused_logprobs(hidden, weight, targets, temperature, token_chunk=4, with_entropy=False)
    assert none is None
    torch.testing.assert_close(logp_only, logp, rtol=0, atol=0)


def test_gradient_only_where_asked():
    hidden, weight, targets, temperature, upstream = make_inputs(10, 30, 8, torch.float32, True, seed=4)
    frozen = weight.detach()
    logp, _ = fused_logprobs(hidden, frozen, targets, temperature, token_chunk=3, vocab_chunk=8)
    (grad_hidden,) = torch.autograd.grad((logp * upstream).sum(), hidden)
    ref_logp, _ = reference_logprobs(hidden, frozen, targets, temperature)
    assert_near(grad_hidden, torch.autograd.grad((ref_logp * upstream.double()).sum(), hidden)[0],
                torch.float32, "grad hidden")
    with torch.no_grad():
        assert not fused_logprobs(hidden, weight, targets, temperature, token_chunk=3)[0].requires_grad


def test_autocast_does_not_change_the_result():
    hidden, weight, targets, temperature, _ = make_inputs(8, 30, 8, torch.float32, True, seed=6)
    plain = fused_logprobs(hidden, weight, targets, temperature, token_chunk=3)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = fused_logprobs(hidden, weight, targets, temperature, token_chunk=3)[0]
    torch.testing.assert_close(autocast, plain, rtol=0, atol=0)


def test_matches_the_cores_chunked_logprob_over_logits():
    from prime_core.trainer.model import token_logprob_fn

    hidden, weight, targets, _, _ = make_inputs(33, 70, 8, torch.float32, False, seed=8)
    core_logp, core_entropy = token_logprob_fn()(hidden @ weight.T, targets, 0.6, True)
    logp, entropy = fused_logprobs(hidden, weight, targets, 0.6, token_chunk=10, vocab_chunk=16)
    torch.testing.assert_close(logp, core_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, core_entropy, rtol=1e-5, atol=1e-5)


class LargestTensor(TorchDispatchMode):
    """Records the most elements any op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.largest = max([self.largest, *sizes])
        return out


def test_logits_never_exist_in_full():
    n, vocab, width, token_chunk, vocab_chunk = 40, 400, 2, 20, 150
    hidden, weight, targets, temperature, upstream = make_inputs(n, vocab, width, torch.float32, True, seed=9)
    with LargestTensor() as mode:
        logp, _ = fused_logprobs(hidden, weight, targets, temperature, token_chunk=token_chunk,
                                 vocab_chunk=vocab_chunk)
        # Kept for backward: the inputs, the per-token temperature and log-sum-exp.
        saved = [t for t in logp.grad_fn.saved_tensors if t is not None]
        assert sum(t.numel() for t in saved) == hidden.numel() + weight.numel() + 3 * n
        del saved
        torch.autograd.grad((logp * upstream).sum(), (hidden, weight))
    # Chunks of [token_chunk, vocab_chunk] are the biggest things made (bigger than the gradients here).
    assert mode.largest == token_chunk * vocab_chunk > max(vocab * width, n * width)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_auto_keeps_small_logits_for_the_backward_with_the_same_results(monkeypatch, dtype):
    from prime_plugin_fused_lm_head import chunking

    n, vocab = 40, 300
    check_against_reference(fused_logprobs, n, vocab, 16, dtype, True, "auto", None, seed=4)
    hidden, weight, targets, temperature, upstream = make_inputs(n, vocab, 16, dtype, True, seed=5)
    results = []
    # Kept (the default budget), recomputed (no budget), and an int chunk, which never keeps them.
    default = chunking.KEEP_BUDGET_BYTES
    for budget, chunk, kept in ((default, "auto", 1), (0, "auto", 0), (default, n, 0)):
        monkeypatch.setattr(chunking, "KEEP_BUDGET_BYTES", budget)
        logp, entropy = fused_logprobs(hidden, weight, targets, temperature, token_chunk=chunk)
        saved = [t for t in logp.grad_fn.saved_tensors if t is not None]
        assert [t.dtype for t in saved if t.shape == (n, vocab)] == [dtype] * kept
        del saved
        grads = torch.autograd.grad((logp * upstream).sum(), (hidden, weight), retain_graph=True)
        # The PyTorch blocks read a copy of the kept logits: a second backward gives the same.
        torch.testing.assert_close(torch.autograd.grad((logp * upstream).sum(), (hidden, weight)), grads,
                                   rtol=0, atol=0)
        results.append((logp, entropy, *grads))
    # One chunk either way here, so the same matmuls: the same bits.
    for got in results[1:]:
        for a, b in zip(got, results[0], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    # Without a backward pass nothing is kept (it would only raise the forward's peak).
    from prime_plugin_fused_lm_head import torch_impl

    monkeypatch.setattr(chunking, "KEEP_BUDGET_BYTES", default)
    apply, kept = torch_impl._FusedLogProbs.apply, []
    monkeypatch.setattr(torch_impl._FusedLogProbs, "apply", lambda *args: kept.append(args[-1]) or apply(*args))
    fused_logprobs(hidden, weight, targets, temperature, token_chunk="auto")
    with torch.no_grad():
        no_grad = fused_logprobs(hidden, weight, targets, temperature, token_chunk="auto")[0]
    fused_logprobs(hidden.detach(), weight.detach(), targets, temperature, token_chunk="auto")
    assert kept == [True, False, False]
    torch.testing.assert_close(no_grad, results[0][0], rtol=0, atol=0)


def test_rejects_bad_arguments():
    hidden, weight, targets, _, _ = make_inputs(4, 10, 8, torch.float32, False, seed=1)
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        fused_logprobs(hidden, weight, torch.tensor([0, 1, 10, 2]), 1.0, token_chunk=2)
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        fused_logprobs(hidden, weight, torch.tensor([0, -1, 1, 2]), 1.0, token_chunk=2)
    with pytest.raises(ValueError, match="weight"):
        fused_logprobs(hidden, weight[:, :4], targets, 1.0, token_chunk=2)
    with pytest.raises(ValueError, match="bfloat16"):
        fused_logprobs(hidden, weight.bfloat16(), targets, 1.0, token_chunk=2)
    with pytest.raises(ValueError, match="targets"):
        fused_logprobs(hidden, weight, targets.int(), 1.0, token_chunk=2)
    with pytest.raises(ValueError, match="positive"):
        fused_logprobs(hidden, weight, targets, 0.0, token_chunk=2)
    with pytest.raises(ValueError, match="positive integers"):
        fused_logprobs(hidden, weight, targets, 1.0, token_chunk=0)
    with pytest.raises(ValueError, match="positive integers"):
        fused_logprobs(hidden, weight, targets, 1.0, token_chunk=2, vocab_chunk=0)
    with pytest.raises(ValueError, match="3 values for 4 tokens"):
        fused_logprobs(hidden, weight, targets, torch.ones(3), token_chunk=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("n", "vocab", "token_chunk", "vocab_chunk"), [
    (40, 300, 6, None),  # the vocabulary outside, slices of 7 rows, several token tiles per slice
    (40, 300, 6, 50),
    (5, 300, 6, 50),     # one token tile: only the hidden states' rows are summed
    (90, 30, 8, 7),      # more tokens than vocabulary rows: the tokens outside
])
def test_backward_tiles_in_either_order(monkeypatch, n, vocab, token_chunk, vocab_chunk, dtype):
    from prime_plugin_fused_lm_head import chunking

    monkeypatch.setattr(chunking, "VOCAB_SLICE", 7)
    check_against_reference(fused_logprobs, n, vocab, 16, dtype, True, token_chunk, vocab_chunk, seed=n * vocab)
