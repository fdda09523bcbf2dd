"""``chunk_size_for``: the ``"auto"`` token chunk."""

import pytest
import torch

from prime_plugin_fused_lm_head.chunking import DEFAULT_BUDGET_BYTES, bytes_per_token, chunk_size_for


def test_largest_chunk_within_the_budget():
    per_token = bytes_per_token(1000, 64, torch.bfloat16)
    assert per_token == 2 * 4 * 1000 + 2 * 64
    budget = 10 * per_token + per_token // 2
    assert chunk_size_for(10_000, 1000, 64, torch.bfloat16, budget_bytes=budget) == 10
    assert chunk_size_for(10_000, 1000, 64, torch.bfloat16, budget_bytes=10 * per_token) == 10
    assert chunk_size_for(10_000, 1000, 64, torch.bfloat16, budget_bytes=10 * per_token - 1) == 9


def test_default_budget_keeps_the_float32_logits_chunk_within_1_gib():
    heads = [(151_936, 4096, torch.bfloat16), (32_000, 8192, torch.float32), (50, 8, torch.float16)]
    for vocab, hidden, dtype in heads:
        chunk = chunk_size_for(1 << 30, vocab, hidden, dtype)
        assert chunk * vocab * 4 <= 1 << 30
        assert (chunk + 1) * bytes_per_token(vocab, hidden, dtype) > DEFAULT_BUDGET_BYTES
    assert chunk_size_for(1 << 20, 151_936, 4096, torch.bfloat16) == 1754


def test_float64_counts_float64_rows():
    assert bytes_per_token(100, 10, torch.float64) == 2 * 8 * 100 + 8 * 10


def test_never_more_than_the_tokens_and_at_least_one():
    assert chunk_size_for(37, 1000, 64, torch.bfloat16) == 37
    assert chunk_size_for(0, 1000, 64, torch.bfloat16) == 1
    assert chunk_size_for(100, 10**9, 64, torch.bfloat16, budget_bytes=1024) == 1


def test_smaller_vocabulary_chunk_allows_more_tokens():
    whole = chunk_size_for(1 << 20, 150_000, 4096, torch.bfloat16)
    assert chunk_size_for(1 << 20, 15_000, 4096, torch.bfloat16) > 9 * whole


@pytest.mark.parametrize("args", [(-1, 10, 4), (5, 0, 4), (5, 10, 0)])
def test_rejects_bad_sizes(args):
    with pytest.raises(ValueError, match="must be positive"):
        chunk_size_for(*args, torch.float32)
    with pytest.raises(ValueError, match="must be positive"):
        chunk_size_for(5, 10, 4, torch.float32, budget_bytes=0)
