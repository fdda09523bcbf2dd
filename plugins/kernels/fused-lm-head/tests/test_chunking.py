"""``chunk_size_for``: the ``"auto"`` token chunk."""

import pytest
import torch

from prime_plugin_fused_lm_head.chunking import (
    DEFAULT_BUDGET_BYTES,
    accumulator_bytes,
    backward_tiles,
    bytes_per_token,
    chunk_size_for,
    keeps_logits,
)


def test_largest_chunk_within_the_budget():
    per_token = bytes_per_token(1000, 64, torch.bfloat16)
    assert per_token == 2 * 4 * 1000 + 2 * 64
    budget = 10 * per_token + per_token // 2
    assert chunk_size_for(10_000, 1000, 64, torch.bfloat16, budget_bytes=budget) == 10
    assert chunk_size_for(10_000, 1000, 64, torch.bfloat16, budget_bytes=10 * per_token) == 10
    assert chunk_size_for(10_000, 1000, 64, torch.bfloat16, budget_bytes=10 * per_token - 1) == 9


def test_default_budget_keeps_a_chunk_within_256_mib():
    heads = [(151_936, 4096, torch.bfloat16), (32_000, 8192, torch.float32), (50, 8, torch.float16)]
    for vocab, hidden, dtype in heads:
        chunk = chunk_size_for(1 << 30, vocab, hidden, dtype)
        assert chunk * bytes_per_token(vocab, hidden, dtype) <= 256 << 20
        assert (chunk + 1) * bytes_per_token(vocab, hidden, dtype) > DEFAULT_BUDGET_BYTES
    assert chunk_size_for(1 << 20, 151_936, 4096, torch.bfloat16) == 219
    # The Triton kernels' single bf16 row: 871 tokens of the 1.7B shape's head.
    assert chunk_size_for(1 << 20, 151_936, 2048, torch.bfloat16, softmax_rows=0) == 871


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


def test_backward_tiles_keep_the_smaller_accumulator():
    # 32k tokens, the Triton chunk of the 1.7B head: the vocabulary outside, three token tiles
    # a slice, so the float32 buffers are the hidden states' 256 MiB and one 64 MiB slice.
    assert backward_tiles(32_768, 151_936, 871, 151_936) == (True, 10_923, 8192)
    assert accumulator_bytes(32_768, 151_936, 2048, 871, 151_936) == (32_768 + 8192) * 2048 * 4
    # Fewer tokens than one chunk: one token tile; only the hidden states' rows are summed.
    assert backward_tiles(500, 151_936, 870, 151_936) == (True, 500, 151_936)
    assert accumulator_bytes(500, 151_936, 2048, 870, 151_936) == 0
    assert backward_tiles(500, 151_936, 870, 50_000) == (True, 500, 50_000)
    assert accumulator_bytes(500, 151_936, 2048, 870, 50_000) == 500 * 2048 * 4
    # More tokens than vocabulary rows: the weight's gradient is the smaller buffer.
    assert backward_tiles(1 << 20, 151_936, 870, 151_936) == (False, 870, 151_936)
    assert accumulator_bytes(1 << 20, 151_936, 2048, 870, 151_936) == 151_936 * 2048 * 4
    # Never a tile larger than the forward chunk's area.
    for n in (1, 9_000, 40_000, 151_936):
        _, tokens, vocab = backward_tiles(n, 151_936, 870, 151_936)
        assert tokens * vocab <= 870 * 151_936


def test_auto_keeps_the_logits_of_8k_tokens_not_of_16k():
    # Qwen3's vocabulary in bf16: 2.3 GiB at 8k tokens, 4.6 GiB at 16k (the budget is 4 GiB).
    assert keeps_logits(8192, 151_936, torch.bfloat16)
    assert not keeps_logits(16_384, 151_936, torch.bfloat16)
    assert not keeps_logits(8192, 151_936, torch.float32)
    assert keeps_logits(100, 1000, torch.bfloat16, budget_bytes=200_000)
    assert not keeps_logits(100, 1000, torch.bfloat16, budget_bytes=199_999)
