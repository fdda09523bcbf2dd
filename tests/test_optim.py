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


def test_no_gradients():
    assert clip_grad_norm([], 1.0) == 0.0
