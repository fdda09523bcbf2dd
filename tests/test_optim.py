"""Gradient clipping on local shards matches torch's reference on plain tensors (the sharded
case is covered by the parity tests against one eager process)."""

import pytest
import torch

from prime_core.trainer.optim import clip_grad_norm


def _params(seed, dtype):
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n in (7, 300, 1)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator, dtype=dtype) * 3
    return params


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("max_norm", [None, 1.0, 1e6])
def test_clip_matches_torch(dtype, max_norm):
    ours, theirs = _params(0, dtype), _params(0, dtype)
    norm = clip_grad_norm(ours, max_norm)
    want = torch.nn.utils.clip_grad_norm_(theirs, max_norm or float("inf"))
    assert norm.dtype == dtype
    torch.testing.assert_close(norm, want)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def test_a_16_bit_gradient_norm_is_taken_in_float32():
    """The norm of bf16 gradients is their float32 casts' norm, not rounded to bf16 per tensor
    (3 digits); the gradients are scaled by the clip factor in bf16."""
    ours, theirs = _params(1, torch.bfloat16), _params(1, torch.float32)
    for a, b in zip(ours, theirs, strict=True):
        b.grad = a.grad.float()
    norm = clip_grad_norm(ours, 1.0)
    want = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert norm.dtype == torch.float32
    torch.testing.assert_close(norm, want, rtol=1e-6, atol=0)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad.float(), b.grad, rtol=2 ** -7, atol=0)


def test_no_gradients():
    assert clip_grad_norm([], 1.0) == 0.0
