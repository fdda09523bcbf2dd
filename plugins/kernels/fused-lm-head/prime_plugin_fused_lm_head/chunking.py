"""How many tokens one chunk of the LM head may hold (``fused_lm_head_token_chunk_size = "auto"``).

Shared by every implementation of ``lm_head:fused``; imports nothing (a ``torch.dtype`` only
has to tell its ``itemsize``).
"""

from __future__ import annotations

DEFAULT_BUDGET_BYTES = 256 << 20
"""256 MiB of transient memory per chunk (``bytes_per_token`` below). Smaller chunks cost
little time: at a 151,936-entry vocabulary and bf16 the Triton head's chunk is still 871 tokens,
a matmul of 0.5 TFLOP; what they save is most of the head's memory (issue 20: at most 1 GiB
beyond its inputs and gradients at 32k tokens)."""

KEEP_BUDGET_BYTES = 4 << 30
"""``"auto"`` keeps the forward's ``[tokens, vocab]`` logits (in the inputs' dtype) for the
backward pass when they take at most this much (``keeps_logits``). The backward then reads them
instead of recomputing them: one ``tokens × vocab × hidden`` matmul less, a quarter of the
head's matmul work. 8,192 tokens of a 151,936-entry vocabulary take 2.3 GiB in bf16 and are
kept; 16k tokens (4.6 GiB) and more are recomputed, so at 32k tokens the head still adds well
under 1 GiB (issue 20). An int token chunk never keeps them."""

VOCAB_SLICE = 8192
"""Vocabulary rows per backward tile when the backward pass walks the vocabulary in the outer
loop: the float32 accumulator of that slice of the weight's gradient (``backward_tiles``)."""


def bytes_per_token(vocab: int, hidden: int, dtype, softmax_rows: int = 2) -> int:
    """Transient bytes one token of a chunk costs at the peak of the forward or backward pass.

    Two rows of ``vocab`` in the softmax dtype (float32, float64 for float64 inputs): the
    scaled logits and their exponentials in the forward, the logits and their gradient cast
    to the input dtype in the backward (never more than two float32 rows); plus one row of
    ``hidden`` in the input dtype, the chunk's product with the weight before it is added to
    the float32 gradient of ``hidden``. What lives for the whole call (the float32 gradient
    buffers, the per-token log-sum-exp) does not depend on the chunk and is not counted.

    ``softmax_rows = 0`` counts the Triton implementation instead: its kernels read the
    logits in the input dtype and write the gradient over them, one row of ``vocab`` in the
    input dtype.
    """
    itemsize = int(dtype.itemsize)
    rows = softmax_rows * max(4, itemsize) if softmax_rows else itemsize
    return rows * vocab + itemsize * hidden


def chunk_size_for(n_tokens: int, vocab: int, hidden: int, dtype, budget_bytes: int = DEFAULT_BUDGET_BYTES,
                   softmax_rows: int = 2) -> int:
    """The largest token chunk whose working set (``bytes_per_token``) fits ``budget_bytes``.

    ``vocab`` is what one chunk spans: the whole vocabulary, or the vocabulary chunk when one is
    set. Never more than ``n_tokens`` (one chunk then covers everything) and at least 1, even
    when a single token exceeds the budget: the LM head still has to run.
    """
    if n_tokens < 0 or vocab < 1 or hidden < 1 or budget_bytes < 1:
        raise ValueError(f"chunk_size_for(n_tokens={n_tokens}, vocab={vocab}, hidden={hidden}, "
                         f"budget_bytes={budget_bytes}): sizes must be positive (n_tokens may be 0)")
    fits = budget_bytes // bytes_per_token(vocab, hidden, dtype, softmax_rows)
    return max(1, min(n_tokens, fits))


def keeps_logits(n_tokens: int, vocab: int, dtype, budget_bytes: int | None = None) -> bool:
    """Whether ``"auto"`` keeps the whole ``[n_tokens, vocab]`` logits for the backward pass
    (``budget_bytes``: ``KEEP_BUDGET_BYTES`` as it is when called)."""
    budget = KEEP_BUDGET_BYTES if budget_bytes is None else budget_bytes
    return n_tokens * vocab * int(dtype.itemsize) <= budget


def backward_tiles(n_tokens: int, vocab: int, token_chunk: int, vocab_chunk: int) -> tuple[bool, int, int]:
    """``(vocab_outer, token_tile, vocab_tile)``: how the backward pass tiles the
    ``[tokens, vocab]`` plane, each tile as large as one forward chunk (``token_chunk`` by
    ``vocab_chunk``) so its working set stays within the same budget.

    Gradients summed over more than one tile are accumulated in float32, and the order of the
    two loops decides which accumulator lives for the whole call: walking the vocabulary
    outside, the hidden states' ``[tokens, H]`` (and one ``[vocab_tile, H]`` slice of the
    weight's); walking the tokens outside, the weight's ``[vocab, H]`` (and one
    ``[token_tile, H]`` slice of the hidden states'). The smaller of the two is chosen: up to
    32k tokens against a 151,936-entry vocabulary that is the hidden states' 256 MiB instead of
    the weight's 1.2 GiB. A gradient computed by one tile alone is written straight into its
    result, without an accumulator."""
    vocab_chunk = min(vocab, vocab_chunk)
    if n_tokens > vocab:
        return False, token_chunk, vocab_chunk
    if n_tokens <= token_chunk:
        return True, max(1, n_tokens), vocab_chunk
    vocab_tile = min(vocab_chunk, VOCAB_SLICE)
    most = max(1, token_chunk * vocab_chunk // vocab_tile)
    tiles = -(-n_tokens // most)
    return True, -(-n_tokens // tiles), vocab_tile


def accumulator_bytes(n_tokens: int, vocab: int, hidden: int, token_chunk: int, vocab_chunk: int,
                      grad_itemsize: int = 4) -> int:
    """Bytes of float32 gradient accumulators ``backward_tiles`` needs at once (``prime plan``)."""
    vocab_outer, token_tile, vocab_tile = backward_tiles(n_tokens, vocab, token_chunk, vocab_chunk)
    many_tokens, many_vocab = n_tokens > token_tile, vocab > vocab_tile
    if vocab_outer:
        rows = (n_tokens if many_vocab else 0) + (vocab_tile if many_tokens else 0)
    else:
        rows = (vocab if many_tokens else 0) + (token_tile if many_vocab else 0)
    return rows * hidden * grad_itemsize
