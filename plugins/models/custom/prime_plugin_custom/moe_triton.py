"""The local dispatcher's permutation in two Triton kernels, for CUDA tensors.

Dispatch copies every token to its ``k`` rows of the expert-sorted layout; combine sums a
token's ``k`` expert outputs weighted by the router. In PyTorch operations (``moe.gather_rows``)
these are gathers, which Inductor ran at about 1 TB/s on an H200 (five kernels, 1.03 ms a
layer forward and backward at the 2.9B MoE shape, 8k tokens). Here both directions take one
token per program and reach the permuted rows through ``inverse`` (copy ``j`` of token ``t``
sits at row ``inverse[t * k + j]``):

- dispatch: ``copy_rows`` writes ``x[t]`` to its ``k`` rows (``x`` read once); its backward is
  ``sum_rows``, the sum of those rows' gradients;
- combine: ``sum_rows`` weighted by ``topk_weight``; its backward is ``copy_rows`` weighted,
  which also takes the router weight's gradient, ``<grad_out[t], y[inverse[t * k + j]]>``, in
  the same pass, from the expert outputs themselves.

Four launches, about 0.6 ms a layer there; the compiled layer forward and backward takes
4.73 ms against 5.39 with the gathers (``kernels_bench.py moe``), and the whole MoE step runs
4.8-6.1% faster (stop 42, ``docs/trainer.md``). Sums are in float32, rounded once; the PyTorch
path rounds each weighted copy to the compute dtype before summing, so on bfloat16 the two
differ by that rounding (``tests/test_moe_triton.py`` checks both against a float64 reference).

Each kernel is also a ``torch.library.triton_op`` (``prime_moe::*``), which is what a compiled
block gets (Inductor launches the kernel from its own code); eager calls launch it directly.
Importing this module registers the operators, which imports triton: ``moe`` imports it where
triton is installed, so that a compiled block can name the operators.
"""

from __future__ import annotations

import torch
from torch.library import triton_op, wrap_triton


def dispatch(x: torch.Tensor, inverse: torch.Tensor, copies: int) -> torch.Tensor:
    """``x [T, H]`` -> ``[T * copies, H]``, row ``inverse[t * copies + j]`` a copy of ``x[t]``;
    differentiable in ``x``."""
    return _Dispatch.apply(x, inverse, copies)


def combine(y: torch.Tensor, inverse: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``y [T * k, H]``, ``weight [T, k]`` -> ``[T, H]``: ``sum_j weight[t, j] *
    y[inverse[t * k + j]]``; differentiable in ``y`` and ``weight``."""
    return _Combine.apply(y, inverse, weight)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, inverse, copies):
        ctx.save_for_backward(inverse)
        ctx.copies = copies
        return _call(_copy_rows_op, _copy_rows, x, inverse, None, None, copies)[0]

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return _call(_sum_rows_op, _sum_rows, grad, inverse, None, ctx.copies), None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, inverse, weight):
        ctx.save_for_backward(y, inverse, weight)
        return _call(_sum_rows_op, _sum_rows, y, inverse, weight, weight.shape[1])

    @staticmethod
    def backward(ctx, grad):
        y, inverse, weight = ctx.saved_tensors
        other = y if ctx.needs_input_grad[2] else None
        grad_y, dots = _call(_copy_rows_op, _copy_rows, grad, inverse, weight, other, weight.shape[1])
        return grad_y, None, dots.to(weight.dtype) if other is not None else None


def _call(op, direct, *args):
    # The operator inside a graph being compiled, the launch itself otherwise (no dispatch).
    return op(*args) if torch.compiler.is_compiling() else direct(*args, _direct)


def _direct(kernel):
    return kernel


TILE, SPAN, WARPS = 16384, 0, 8
"""The launch (``kernels_bench.py moe --launch``): elements of a ``[copies, features]`` tile,
features a program covers (0: the whole row, in a loop of tiles), warps a program. On the
H200 at H = 2,048 and k = 8 a whole row a tile won: programs covering 256 features (grid
``[T, 8]``) ran the gathering sum at a third of the speed, 609 µs against 182."""


def _tiles(h: int, copies: int) -> tuple[int, dict]:
    """(programs a token, the kernels' launch arguments)."""
    copies_p2 = 1 << max(copies - 1, 0).bit_length()
    block = max(16, min(1 << max(h - 1, 0).bit_length(), TILE // copies_p2))
    span = -(-(SPAN or h) // block) * block
    return -(-h // span), dict(COPIES=copies, COPIES_P2=copies_p2, BLOCK=block, SPAN=span, num_warps=WARPS)


def _copy_rows(src, inverse, weight, other, copies, launch):
    tokens, h = src.shape
    src = src.contiguous()
    blocks, tiles = _tiles(h, copies)
    dst = torch.empty(tokens * copies, h, dtype=src.dtype, device=src.device)
    # The dot products by feature block, summed after in a fixed order (no atomics).
    parts = torch.empty(tokens, copies if other is not None else 0, blocks, dtype=torch.float32, device=src.device)
    if tokens and h:
        # An unused pointer gets ``src``: the kernel never reads it, and no empty tensor is passed.
        launch(_kernels().copy_rows)[(tokens, blocks)](
            src, inverse, weight.contiguous() if weight is not None else src, dst,
            other.contiguous() if other is not None else src, parts if other is not None else src, h,
            WEIGHTED=weight is not None, DOT=other is not None, **tiles)
    return dst, parts.sum(dim=-1)


def _sum_rows(src, inverse, weight, copies, launch):
    rows, h = src.shape
    tokens = rows // copies
    src = src.contiguous()
    dst = torch.empty(tokens, h, dtype=src.dtype, device=src.device)
    blocks, tiles = _tiles(h, copies)
    if tokens and h:
        launch(_kernels().sum_rows)[(tokens, blocks)](src, inverse, weight.contiguous() if weight is not None else src,
                                                      dst, h, WEIGHTED=weight is not None, **tiles)
    return dst


@triton_op("prime_moe::copy_rows", mutates_args=())
def _copy_rows_op(src: torch.Tensor, inverse: torch.Tensor, weight: torch.Tensor | None,
                  other: torch.Tensor | None, copies: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _copy_rows(src, inverse, weight, other, copies, wrap_triton)


@triton_op("prime_moe::sum_rows", mutates_args=())
def _sum_rows_op(src: torch.Tensor, inverse: torch.Tensor, weight: torch.Tensor | None,
                 copies: int) -> torch.Tensor:
    return _sum_rows(src, inverse, weight, copies, wrap_triton)


def _kernels():
    """The kernels' module, imported on first use (a CPU test switches the interpreter on first)."""
    from prime_plugin_custom import moe_kernels

    return moe_kernels
