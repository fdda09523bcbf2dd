"""The FP8 weights' 128×128 blocks, kept from a step's first forward pass for its later ones.

Within an optimizer step the weights do not change, yet every forward pass of the step (one per
micro-batch, and again under activation checkpointing) quantised each weight into its blocks:
a memory-bound kernel in front of the forward GEMM (6 µs of the 1.7B ``o`` linear's 223 at
M = 8,192 on an H200). Transformer Engine keeps them for the same reason (its
``is_first_microbatch``). The backward's ``W.T`` blocks are not kept: they run on the side
stream beside the weight gradient (``linear._input_grad_beside_weight_grad``), and keeping them
would cost a second byte a weight.

When blocks are stored, from the trainer's hooks (``before_backward`` and ``before_step``, which
the ``fp8`` strategy hands the trainer as ``Applied`` hooks):

- only in a step after one of more than one backward pass (a step of one pass gains nothing,
  and the blocks would sit beside the forward's activations and the LM head's peak);
- not from the step's last backward pass on: its forward has used them, so they are dropped
  there, before the backward's peak;
- everything is dropped at ``before_step``, before the update. The fused AdamW writes the
  weights in place from a Triton kernel, which no version counter sees.

A stored entry is used only while each of its weights is the same tensor at the same address
and version (an in-place change through torch, such as a checkpoint load, bumps the version).
So the blocks used are always the ones quantising the weights would give, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable


class WeightCache:
    """Blocks by weight group, stored and dropped as the module docstring says. ``hits`` and
    ``misses`` count lookups (for tests and benchmarks)."""

    def __init__(self) -> None:
        from torch.utils.weak import WeakIdKeyDictionary

        self._entries = WeakIdKeyDictionary()  # first weight of a group -> (signature, blocks)
        self.storing = False
        """Whether a miss stores what it quantised (the trainer's hooks set it; a benchmark may)."""
        self._passes = 0
        self.hits = self.misses = 0

    def blocks(self, weights: list, quantize: Callable[[list], tuple]) -> tuple:
        """``quantize(weights)``, or what it gave for the same weights earlier in the step."""
        signature = tuple((id(w), w.data_ptr(), w._version, tuple(w.shape), w.dtype) for w in weights)
        entry = self._entries.get(weights[0])
        if entry is not None and entry[0] == signature:
            self.hits += 1
            return entry[1]
        self.misses += 1
        blocks = quantize(weights)
        if self.storing:
            self._entries[weights[0]] = (signature, blocks)
        elif entry is not None:
            del self._entries[weights[0]]
        return blocks

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def before_backward(self, _model, last: bool) -> None:
        """``Applied.before_backward``: count the step's passes; at its last, drop everything."""
        self._passes += 1
        if last:
            self.storing = False
            self.clear()

    def before_step(self, _model) -> None:
        """``Applied.before_step``: drop everything before the update; store in the next step
        only if this one had more than one pass."""
        self.storing = self._passes > 1
        self._passes = 0
        self.clear()


CACHE = WeightCache()
"""The process's cache: the FP8 linears converted with ``cache_weight=True`` use it (one model
trains in a trainer process; entries are per weight, so others cannot be served stale ones)."""
