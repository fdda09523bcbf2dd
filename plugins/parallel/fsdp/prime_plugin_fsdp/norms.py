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

``GROUPED`` launches the squares of ``GROUP`` gradients at a time (``adamw_kernel.
squares_of_table``, an address table like the update's) instead of one launch a gradient: each
launch is host time (a stream wait, Triton's launcher, a ``record_stream``), 310 of them in the
1.7B shape's last backward pass, about 60 ms a step under the profiler on an H100 (stop 74), on
the path of a step the host bounds (FP8 over RL rows). The same partial sums either way.
"""

from __future__ import annotations

import weakref

GROUPED = False
"""Whether the squares are launched a group of gradients at a time (the module docstring).
``False`` until timed on a GPU beside the launch a gradient (``trainer_memory.py --set
grouped_norms=on``); the same sums either way."""

GROUP = 16
"""Gradients a grouped launch sums (``GROUPED``): one launch for every ``GROUP`` gradients of the
last backward pass, so the squares still run beside the rest of that pass."""


class GradientNorms:
    """The squared norm of the gradients of ``masters`` (one gradient or ``None`` each)."""

    def __init__(self, masters: list) -> None:
        self.masters = masters
        self.armed = False
        self._taken: dict[int, tuple] = {}  # index -> (weak reference to the gradient, its version)
        self._pending: dict = {}  # dtype -> [(index, gradient)] taken and not yet launched (GROUPED)
        self._first: list[int] | None = None  # each master's first slot
        self._sums = None
        self._stream = None

    def arm(self, last: bool) -> None:
        """Before a backward pass: take the gradients as they are accumulated if this pass is
        the step's last (``last``); otherwise forget what was taken."""
        self._taken.clear()
        self._pending.clear()
        self.armed = last
        if last:
            self._slots().zero_()

    def take(self, index: int, grad) -> None:
        """After master ``index``'s gradient was accumulated: if armed, sum its squares now,
        on the side stream on a GPU."""
        from prime_plugin_fsdp.adamw import readable

        if not self.armed or not readable(grad):
            return
        self._taken[index] = (weakref.ref(grad), grad._version)
        if not GROUPED:
            self._beside(grad.device, [(index, grad)])
            return
        group = self._pending.setdefault(grad.dtype, [])
        group.append((index, grad))
        if len(group) == GROUP:
            self._beside(grad.device, group)
            group.clear()

    def _beside(self, device, group: list) -> None:
        """The squares of ``group`` (``(index, gradient)`` pairs), on the side stream on a GPU."""
        if device.type != "cuda":  # Triton's interpreter: the same sums, in order
            self._launch_all(group)
            return
        import torch

        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        self._stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._stream):
            self._launch_all(group)
        for _, grad in group:
            grad.record_stream(self._stream)

    def squared(self, gradients: list):
        """The sum of the squares of ``gradients`` (readable; one per master, or ``None``), in
        float32: what was taken in the last backward pass, the rest summed now."""
        import torch

        sums = self._slots()
        if not self.armed:
            sums.zero_()  # nothing was taken: the slots of a missing gradient must read 0
        else:
            for group in self._pending.values():  # before the fix-ups below, which may overwrite them
                if group:
                    self._beside(sums.device, group)
            self._pending.clear()
            if self._stream is not None:
                torch.cuda.current_stream(sums.device).wait_stream(self._stream)
        again = []
        for index, grad in enumerate(gradients):
            taken = self._taken.get(index)
            if grad is None:
                if taken is not None:  # taken, then dropped: its slots must read 0 again
                    first = self._first[index]
                    sums[first:first + self._count(self.masters[index])].zero_()
            elif taken is None or taken[0]() is not grad or taken[1] != grad._version:
                again.append((index, grad))
        self._launch_all(again)
        self._taken.clear()
        self.armed = False
        return sums.sum()

    def _launch_all(self, group: list) -> None:
        """The squares of ``group``'s gradients into their slots, on the current stream."""
        if not GROUPED:
            for index, grad in group:
                self._launch(index, grad)
            return
        by_dtype: dict = {}
        for index, grad in group:
            if grad.numel():
                by_dtype.setdefault(grad.dtype, []).append((index, grad))
        for same in by_dtype.values():
            for start in range(0, len(same), GROUP):
                self._launch_table(same[start:start + GROUP])

    def _launch_table(self, group: list) -> None:
        """One ``squares_of_table`` launch over ``group`` (at most ``GROUP`` gradients of one dtype;
        the kernel reads its table in a power of two of rows)."""
        from prime_plugin_fsdp.adamw import NORM_BLOCK, NORM_WARPS, _addresses, _triton_type
        from prime_plugin_fsdp.adamw_kernel import squares_of_table

        rows, programs = [], 0
        for index, grad in group:
            rows.append((grad.data_ptr(), grad.numel(), self._first[index], programs))
            programs += self._count(grad)
        table = _addresses(rows, group[0][1].device)
        squares_of_table[(programs,)](table, len(rows), self._sums, GRAD=_triton_type(group[0][1].dtype),
                                      BLOCK=NORM_BLOCK, ROWS=1 << (GROUP - 1).bit_length(), num_warps=NORM_WARPS)

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
