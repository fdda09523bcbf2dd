"""Hooks of prime-plugin-fused-lm-head: the ``lm_head:fused`` kernel, per-token
log-probabilities and entropies computed from the hidden states a chunk at a time, so the
``[N, V]`` logits never exist.

``fused`` is the PyTorch implementation (``torch_impl``), usable on any device. Importing this
module stays cheap: torch is imported when the kernel first runs.
"""

from __future__ import annotations

from prime_core import hookimpl
from prime_core.specs import Kernel

PRIME_PLUGIN_API = 1


def _fused_logprobs(hidden, weight, targets, temperature=1.0, *, token_chunk, vocab_chunk=None,
                    with_entropy=True):
    from prime_plugin_fused_lm_head.torch_impl import fused_logprobs

    return fused_logprobs(hidden, weight, targets, temperature, token_chunk=token_chunk, vocab_chunk=vocab_chunk,
                          with_entropy=with_entropy)


@hookimpl
def prime_kernels():
    return [
        Kernel(op="lm_head", name="fused", impl=_fused_logprobs, reference="eager logits + log_softmax in float64",
               description="chunked LM head in PyTorch: log p(target) and entropy without the [N, V] logits"),
    ]
