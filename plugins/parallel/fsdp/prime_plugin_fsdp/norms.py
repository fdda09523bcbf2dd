"""The gradients' squares, summed while the step's last backward pass runs.

The fused update (``adamw.step``) clips by the norm of every gradient, so it cannot start
before the norm is known: on its own, the norm is a pass over every gradient after the
backward pass (1.6 ms of the 2.9B MoE shape's 115 ms step on an H200). But a gradient is
final once the step's last backward pass has accumulated it (``Applied.before_backward``
says which pass is the last), while that pass goes on to the layers before it. So each
gradient's squares are summed then, on a side stream, beside the matmuls of the backward
pass; the update waits for that stream and sums what it has not seen.

The sums are kept per ``NORM_BLOCK`` of each gradient (``adamw_kernel.squares``), in slots
that depend only on the weights' sizes, so a norm is the same sum of the same partial sums
whichever stream or pass computed them. A gradient changed after its squares were taken (a
later accumulation, a clone) is summed again at the update: what was taken is recorded with
the tensor (weakly) and its version.
"""

from __future__ import annotations

import weakref


class GradientNorms:
    """The squared norm of the gradients of ``masters`` (one gradient or ``None`` each)."""

    def __init__(self, masters: list) -> None:
        self.masters = masters
        self.armed = False
        self._taken: dict[int, tuple] = {}  # index -> (weak reference to the gradient, its version)
        self._first: list[int] | None = None  # each master's first slot
        self._sums = None
        self._stream = None

    def arm(self, last: bool) -> None:
        """Before a backward pass: take the gradients as they are accumulated if this pass is
        the step's last (``last``); otherwise forget what was taken."""
        self._taken.clear()
        self.armed = last
        if last:
            self._slots().zero_()

    def take(self, index: int, grad) -> None:
        """After master ``index``'s gradient was accumulated: if armed, sum its squares now,
        on the side stream on a GPU."""
        from prime_plugin_fsdp.adamw import readable

        if not self.armed or not readable(grad):
            return
        if grad.is_cuda:
            import torch

            if self._stream is None:
                self._stream = torch.cuda.Stream(grad.device)
            self._stream.wait_stream(torch.cuda.current_stream(grad.device))
            with torch.cuda.stream(self._stream):
                self._launch(index, grad)
            grad.record_stream(self._stream)
        else:  # Triton's interpreter: the same sums, in order
            self._launch(index, grad)
        self._taken[index] = (weakref.ref(grad), grad._version)

    def squared(self, gradients: list):
        """The sum of the squares of ``gradients`` (readable; one per master, or ``None``), in
        float32: what was taken in the last backward pass, the rest summed now."""
        import torch

        sums = self._slots()
        if not self.armed:
            sums.zero_()  # nothing was taken: the slots of a missing gradient must read 0
        elif self._stream is not None:
            torch.cuda.current_stream(sums.device).wait_stream(self._stream)
        for index, grad in enumerate(gradients):
            taken = self._taken.get(index)
            if grad is None:
                if taken is not None:  # taken, then dropped: its slots must read 0 again
                    first = self._first[index]
                    sums[first:first + self._count(self.masters[index])].zero_()
            elif taken is None or taken[0]() is not grad or taken[1] != grad._version:
                self._launch(index, grad)
        self._taken.clear()
        self.armed = False
        return sums.sum()

    def _launch(self, index: int, grad) -> None:
        from prime_plugin_fsdp.adamw import NORM_BLOCK, NORM_WARPS
        from prime_plugin_fsdp.adamw_kernel import squares

        first, count = self._first[index], self._count(grad)
        squares[(count,)](grad, grad.numel(), self._sums[first:first + count], BLOCK=NORM_BLOCK,
                          num_warps=NORM_WARPS)

    @staticmethod
    def _count(tensor) -> int:
        """How many slots (``NORM_BLOCK``s) ``tensor`` has."""
        from prime_plugin_fsdp.adamw import NORM_BLOCK

        return -(-tensor.numel() // NORM_BLOCK)

    def _slots(self):
        if self._sums is None:
            import itertools

            import torch

            counts = [self._count(m) for m in self.masters]
            self._first = [0, *itertools.accumulate(counts)][:-1]
            self._sums = torch.zeros(sum(counts), dtype=torch.float32, device=self.masters[0].device)
        return self._sums
