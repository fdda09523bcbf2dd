"""How many tokens one chunk of the LM head may hold (``fused_lm_head_token_chunk_size = "auto"``).

Shared by every implementation of ``lm_head:fused``; imports nothing (a ``torch.dtype`` only
has to tell its ``itemsize``).
"""

from __future__ import annotations

DEFAULT_BUDGET_BYTES = 2 << 30
"""2 GiB of transient memory per chunk: the two float32 ``[chunk, vocab]`` rows counted below,
so the float32 logits of one chunk stay within 1 GiB (the core's own chunk of logits)."""


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
