"""The FP8 weights' 128×128 blocks, kept from a step's first pass for its later ones.

Within an optimizer step the weights do not change, yet every pass of the step (one per
micro-batch, and again under activation checkpointing) quantised each weight twice: into its
blocks for the forward GEMM, and ``W.T`` into its for the input gradient's (the same 128 × 128
blocks and scales, stored transposed: Hopper's FP8 tensor cores read both operands along K).
Both are memory-bound kernels in front of a GEMM, and in a step of a few thousand tokens a pass
their launches are host time the GPU waits for (stop 73). Transformer Engine keeps the FP8
weight and its transpose for the same reason (its ``is_first_microbatch``). Each costs a byte
a weight while kept.

When blocks are stored, from the trainer's hooks (``before_backward`` and ``before_step``, which
the ``fp8`` strategy hands the trainer as ``Applied`` hooks):

- only in a step after one of more than one backward pass (a step of one pass gains nothing,
  and the blocks would sit beside the forward's activations and the LM head's peak);
- the forward's, by the step's first forward pass; dropped at its last backward pass, whose
  forward has used them, before the backward's peak;
- ``W.T``'s, by the step's first backward pass; the last backward pass uses each once more and
  drops it there, so they shrink through it as its activations do;
- everything is dropped at ``before_step``, before the update. The fused AdamW writes the
  weights in place from a Triton kernel, which no version counter sees.

A stored entry is used only while each of its weights is the same tensor at the same address
and version (an in-place change through torch, such as a checkpoint load, bumps the version).
So the blocks used are always the ones quantising the weights would give, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

TRANSPOSED = True
"""Whether ``W.T``'s blocks are kept too. ``False``: only the forward's (the backward quantises
``W.T`` every pass, a byte a weight less); for timing the two."""


class WeightCache:
    """Blocks by weight group, stored and dropped as the module docstring says. ``hits`` and
    ``misses`` count lookups (for tests and benchmarks)."""

    def __init__(self) -> None:
        from torch.utils.weak import WeakIdKeyDictionary

        # first weight of a group -> (signature, blocks): the forward's, and W.T's
        self._entries = {False: WeakIdKeyDictionary(), True: WeakIdKeyDictionary()}
        self.storing = False
        """Whether a miss stores what it quantised (the trainer's hooks set it; a benchmark may)."""
        self._passes = 0
        self._last = False  # in the step's last backward pass: W.T's blocks are used once more
        self.hits = self.misses = 0

    def blocks(self, weights: list, quantize: Callable[[list], tuple], transposed: bool = False) -> tuple:
        """``quantize(weights)``, or what it gave for the same weights earlier in the step
        (``transposed``: ``W.T``'s blocks, kept apart from the forward's)."""
        entries = self._entries[transposed]
        signature = tuple((id(w), w.data_ptr(), w._version, tuple(w.shape), w.dtype) for w in weights)
        entry = entries.get(weights[0])
        if entry is not None and entry[0] == signature:
            self.hits += 1
            if transposed and self._last:
                del entries[weights[0]]
            return entry[1]
        self.misses += 1
        blocks = quantize(weights)
        if self.storing:
            entries[weights[0]] = (signature, blocks)
        elif entry is not None:
            del entries[weights[0]]
        return blocks

    def clear(self) -> None:
        for entries in self._entries.values():
            entries.clear()

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._entries.values())

    def kept(self, transposed: bool) -> int:
        """How many weight groups' blocks are kept (``transposed``: ``W.T``'s)."""
        return len(self._entries[transposed])

    def before_backward(self, _model, last: bool) -> None:
        """``Applied.before_backward``: count the step's passes; at its last, drop the forward's
        blocks, store nothing more, and let W.T's go as they are used."""
        self._passes += 1
        if last:
            self.storing, self._last = False, True
            self._entries[False].clear()

    def before_step(self, _model) -> None:
        """``Applied.before_step``: drop everything before the update; store in the next step
        only if this one had more than one pass."""
        self.storing = self._passes > 1
        self._passes, self._last = 0, False
        self.clear()


CACHE = WeightCache()
"""The process's cache: the FP8 linears converted with ``cache_weight=True`` use it (one model
trains in a trainer process; entries are per weight, so others cannot be served stale ones)."""
