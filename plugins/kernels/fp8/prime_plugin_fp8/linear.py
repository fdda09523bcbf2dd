"""``fp8_linear``: ``y = x @ W.T + b`` with all three GEMMs of training in block-scaled FP8.

- forward ``y = x @ W.T``: ``x`` 1×128 along K, ``W`` 128×128.
- input gradient ``dx = dy @ W``: ``dy`` 1×128 along N, ``W.T`` 128×128 (the same blocks as
  ``W``'s, stored transposed; quantised from the high-precision weight in the backward, not
  kept from the forward: that would hold an FP8 copy of every weight from the forward to the
  backward).
- weight gradient ``dW = dy.T @ x`` (``fp8_wgrad=True``, as DeepSeek-V3 and Transformer
  Engine do): ``dy.T`` and ``x.T`` each 1×128 along the token dimension, float32 result.
  ``fp8_wgrad=False`` computes it in the inputs' precision instead (a plain matmul); on CUDA
  the input gradient's chain then runs on a second stream beside it (``OVERLAP``).

Saved for the backward, only what a gradient needs: for the weight's, ``x.T`` already
quantised along the tokens (its FP8 operand, which the forward's one pass over ``x``
produces beside the forward's own; a byte a value, where a bf16 ``x`` takes two), or ``x`` in its own
precision under ``fp8_wgrad=False``; for the input's, ``W`` (the parameter itself). The
backward quantises ``dy`` for both its GEMMs in one pass too. The bias is added, and its
gradient summed, in high precision. Master weights are untouched: only the GEMM operands are
FP8. Output and ``dx`` have ``x``'s dtype, ``dW`` the weight's.

Linears of one input (q, k and v; gate and up) can run as one: ``fp8_linears(x, weights,
biases)`` concatenates their FP8 weight blocks, so the input is quantised once, each GEMM is
one wider GEMM, and the backward's two GEMMs and ``dy``'s quantisation are one each for the
group (``FP8Linear.forward_group``; a model calls it through ``project``). The products are
the same as the separate linears' (the blocks are the same blocks); it needs every weight's
row count to be a multiple of 128, so that no 128 × 128 block spans two weights.

``cache_weight=True`` takes the weight blocks, the forward's and ``W.T``'s, from
``weight_cache.CACHE``: quantised by a step's first pass, reused by its later ones while the
trainer's hooks keep them (see ``weight_cache``). Same blocks, so the same bits.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from prime_plugin_fp8 import weight_cache
from prime_plugin_fp8.gemm import gemm
from prime_plugin_fp8.quant import BLOCK, quantize_blocks, quantize_rows, quantize_rows_and_columns


def _weight_blocks(weights: list[torch.Tensor], transposed: bool):
    """The 128×128-block operand of ``cat(weights)`` (``transposed``: of its transpose). No block
    spans two weights, so these are each weight's own blocks; one quantising launch over the
    concatenation costs less host time than one per weight and the concatenations of their
    outputs (the FP8 linear is host-bound, stop 40)."""
    w = weights[0] if len(weights) == 1 else torch.cat(weights)
    return quantize_blocks(w.t() if transposed else w)


# The GEMM as a custom operator: to torch.compile it is one opaque node, so a compiled block
# keeps one graph around its FP8 linears (tracing into the backends' dispatch broke it at
# every linear: stop 29's 1.7B step spent 600 ms on the host for 240 ms of GPU work). The
# quantisers around it are Triton operators (``triton_quant``) that Inductor launches itself.
# Eagerly the GEMM is called directly: the operator's dispatch would only add host time.

@torch.library.custom_op("prime_fp8::gemm", mutates_args=())
def _gemm_op(qa: torch.Tensor, sa: torch.Tensor, qb: torch.Tensor, sb: torch.Tensor, b_block: int,
             out_dtype: torch.dtype, backend: str) -> torch.Tensor:
    return gemm((qa, sa), (qb, sb), b_block=b_block, out_dtype=out_dtype, backend=backend)


@_gemm_op.register_fake
def _(qa, sa, qb, sb, b_block, out_dtype, backend):
    return qa.new_empty((qa.shape[0], qb.shape[0]), dtype=out_dtype)


def _gemm(a, b, b_block: int, out_dtype: torch.dtype, backend: str) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return _gemm_op(*a, *b, b_block, out_dtype, backend)
    return gemm(a, b, b_block=b_block, out_dtype=out_dtype, backend=backend)


def _forward_blocks(weights: list[torch.Tensor]):
    return _weight_blocks(weights, False)


def _transposed_blocks(weights: list[torch.Tensor]):
    return _weight_blocks(weights, True)


def _blocks_of(weights, transposed: bool, cache_weight: bool):
    """The weights' blocks (``transposed``: ``W.T``'s), from the cache where it keeps them."""
    if not cache_weight or (transposed and not weight_cache.TRANSPOSED):
        return _weight_blocks(weights, transposed)
    return weight_cache.CACHE.blocks(weights, _transposed_blocks if transposed else _forward_blocks, transposed)


def _gemm_cached_weight(a, weights, out_dtype: torch.dtype, backend: str, transposed: bool = False) -> torch.Tensor:
    """``a @ cat(weights).T`` (``transposed``: ``a @ cat(weights)``) with the weights' blocks from
    the cache (``weight_cache``)."""
    return gemm(a, _blocks_of(weights, transposed, True), b_block=128, out_dtype=out_dtype, backend=backend)


# The cache is looked up at run time, inside an operator opaque to torch.compile: a traced
# lookup would guard on it, and Inductor could plan the cached blocks' memory as its own.
@torch.library.custom_op("prime_fp8::gemm_cached_weight", mutates_args=())
def _gemm_cached_op(qa: torch.Tensor, sa: torch.Tensor, weights: list[torch.Tensor], out_dtype: torch.dtype,
                    backend: str, transposed: bool) -> torch.Tensor:
    return _gemm_cached_weight((qa, sa), weights, out_dtype, backend, transposed)


@_gemm_cached_op.register_fake
def _(qa, sa, weights, out_dtype, backend, transposed):
    n = weights[0].shape[1] if transposed else sum(w.shape[0] for w in weights)
    return qa.new_empty((qa.shape[0], n), dtype=out_dtype)


def _weight_gemm(rows, weights, out_dtype: torch.dtype, backend: str, cache_weight: bool,
                 transposed: bool = False) -> torch.Tensor:
    """``rows @ cat(weights).T`` (the forward), or ``@ cat(weights)`` (``transposed``: the input
    gradient)."""
    if not cache_weight:
        return _gemm(rows, _weight_blocks(weights, transposed), 128, out_dtype, backend)
    if torch.compiler.is_compiling():
        return _gemm_cached_op(*rows, weights, out_dtype, backend, transposed)
    return _gemm_cached_weight(rows, weights, out_dtype, backend, transposed)


OVERLAP = True
"""With the weight gradient in high precision (``fp8_wgrad=False``) on CUDA: compute the input
gradient's chain on a second stream beside the weight gradient's GEMM. ``False``: one stream,
one kernel after another (the same kernels, so the same bits); for timing the two."""


def _high_precision_weight_grad(g, x2, w_dtype):
    return (g.t().to(x2.dtype) @ x2).to(w_dtype)


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def _input_grad_beside_weight_grad(rows, g, x2, weights, backend: str, x_dtype, w_dtype, cache_weight: bool = False):
    """``(dx, dW)`` from ``g`` and its quantised ``rows``: ``dW``'s high-precision GEMM on the
    current stream, and beside it, on a second one, the rest of ``dx``'s chain (``W.T``'s blocks,
    the FP8 GEMM). Why: nothing orders the two halves, and ``dx``'s kernels take whatever
    multiprocessors ``dW``'s GEMM leaves, at its start and in its tail. On an H200 that was
    1.1-7.5% of the linear's time at M = 8,192 (stop 60, FP8 README), most where ``dW``'s GEMM
    is long. ``cache_weight``: ``W.T``'s blocks from the cache, quantised (on the side stream,
    where they are only ever used) only where it has none.

    ``g``'s rows come quantised, from before the split: compiled, their quantiser is then
    launched by Inductor's generated code, not by Triton's launcher from inside this operator,
    which cost the host more than the kernel took the GPU at an RL step's few thousand tokens a
    pass (stop 73). On the side stream they mostly ran after ``dW``'s GEMM anyway: at the 1.7B
    ``o`` shape cuBLAS runs ``dW`` as 128 blocks on the 132 multiprocessors, and the side stream's
    kernels trickled through the 4 left (kernel timelines, stop 61)."""
    main = torch.cuda.current_stream(g.device)
    side = _side_stream(g.device)
    side.wait_stream(main)  # before dW's launch: the side waits for the rows and the weights only
    grad_w = _high_precision_weight_grad(g, x2, w_dtype)
    with torch.cuda.stream(side):
        grad_x = gemm(rows, _blocks_of(weights, True, cache_weight), b_block=128, out_dtype=x_dtype, backend=backend)
    main.wait_stream(side)
    grad_x.record_stream(main)  # made on the side stream, used and freed on the main one
    return grad_x, grad_w


# Opaque to torch.compile, as the GEMM is: streams are not something a traced graph holds.
@torch.library.custom_op("prime_fp8::input_grad_beside_weight_grad", mutates_args=())
def _grads_op(q: torch.Tensor, scale: torch.Tensor, g: torch.Tensor, x2: torch.Tensor, weights: list[torch.Tensor],
              backend: str, x_dtype: torch.dtype, w_dtype: torch.dtype,
              cache_weight: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _input_grad_beside_weight_grad((q, scale), g, x2, weights, backend, x_dtype, w_dtype, cache_weight)


@_grads_op.register_fake
def _(q, scale, g, x2, weights, backend, x_dtype, w_dtype, cache_weight):
    return g.new_empty(x2.shape, dtype=x_dtype), g.new_empty((g.shape[1], x2.shape[1]), dtype=w_dtype)


def _grads(rows, g, x2, weights, backend: str, x_dtype, w_dtype, cache_weight: bool):
    if torch.compiler.is_compiling():
        return _grads_op(*rows, g, x2, weights, backend, x_dtype, w_dtype, cache_weight)
    return _input_grad_beside_weight_grad(rows, g, x2, weights, backend, x_dtype, w_dtype, cache_weight)


_PARAMS = 4
"""Where ``_FP8Linears.apply``'s weights start: after ``x, backend, fp8_wgrad, cache_weight``."""


class _FP8Linears(torch.autograd.Function):
    """``x @ W_i.T + b_i`` for the group's weights: ``apply(x, backend, fp8_wgrad, cache_weight,
    *weights, *biases)`` (a bias may be ``None``), one output per weight."""

    @staticmethod
    def forward(ctx, x, backend: str, fp8_wgrad: bool, cache_weight: bool, *params):
        count = len(params) // 2
        weights, biases = list(params[:count]), params[count:]
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        needs_x = ctx.needs_input_grad[0]
        needs_w = any(ctx.needs_input_grad[_PARAMS : _PARAMS + count])
        xt = xt_scale = None
        if needs_w and fp8_wgrad:
            rows, (xt, xt_scale) = quantize_rows_and_columns(x2)
        else:
            rows = quantize_rows(x2)
        y = _weight_gemm(rows, weights, x.dtype, backend, cache_weight)
        sizes = [w.shape[0] for w in weights]
        outs = y.split(sizes, dim=1) if count > 1 else (y,)
        outs = tuple((o if b is None else o + b.to(o.dtype)).reshape(*lead, o.shape[1])
                     for o, b in zip(outs, biases, strict=True))
        ctx.save_for_backward(x2 if needs_w and not fp8_wgrad else None, xt, xt_scale,
                              *(weights if needs_x else ()))
        ctx.backend, ctx.fp8_wgrad, ctx.cache_weight = backend, fp8_wgrad, cache_weight
        ctx.count, ctx.sizes = count, sizes
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weights[0].dtype
        ctx.b_dtypes = [None if b is None else b.dtype for b in biases]
        return outs if count > 1 else outs[0]

    @staticmethod
    def backward(ctx, *grad_ys):
        x2, xt, xt_scale, *weights = ctx.saved_tensors
        count, needs = ctx.count, ctx.needs_input_grad
        # An output the loss did not use comes as zeros (autograd materialises them).
        gs = [g.reshape(-1, n) for g, n in zip(grad_ys, ctx.sizes, strict=True)]
        g = gs[0] if count == 1 else torch.cat(gs, dim=1)
        needs_x, needs_w = needs[0], any(needs[_PARAMS : _PARAMS + count])
        grad_x = grad_w = None
        fp8_w = needs_w and ctx.fp8_wgrad
        if needs_x and needs_w and not fp8_w and g.is_cuda and OVERLAP:
            grad_x, grad_w = _grads(quantize_rows(g), g, x2, weights, ctx.backend, ctx.x_dtype, ctx.w_dtype,
                                    ctx.cache_weight)
        else:
            # One quantising pass over g gives both GEMMs' operands (its rows for dx, its
            # columns, g.T's rows, for dW).
            if needs_x and fp8_w:
                rows, columns = quantize_rows_and_columns(g)
            else:
                rows = quantize_rows(g) if needs_x else None
                columns = quantize_rows(g.t()) if fp8_w else None
            if needs_x:
                grad_x = _weight_gemm(rows, weights, ctx.x_dtype, ctx.backend, ctx.cache_weight, transposed=True)
            if fp8_w:
                grad_w = _gemm(columns, (xt, xt_scale), 1, ctx.w_dtype, ctx.backend)
            elif needs_w:
                grad_w = _high_precision_weight_grad(g, x2, ctx.w_dtype)
        if grad_x is not None:
            grad_x = grad_x.reshape(ctx.x_shape)
        grad_ws = [None] * count if grad_w is None else list(grad_w.split(ctx.sizes, dim=0))
        grad_ws = [gw if needs[_PARAMS + i] else None for i, gw in enumerate(grad_ws)]
        grad_bs = [gi.float().sum(0).to(dtype) if dtype is not None and needs[_PARAMS + count + i] else None
                   for i, (gi, dtype) in enumerate(zip(gs, ctx.b_dtypes, strict=True))]
        return grad_x, None, None, None, *grad_ws, *grad_bs


def groupable(rows: list[int]) -> bool:
    """Whether weights of these row counts can run as one group: every 128×128 block within one
    weight (a single weight always can)."""
    return len(rows) == 1 or all(n % BLOCK == 0 for n in rows)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               backend: str = "auto", fp8_wgrad: bool = True, cache_weight: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed in block-scaled FP8 by ``backend`` (``auto``,
    ``deep_gemm``, ``torch``, ``emulated``); ``x [..., K]``, ``weight [N, K]``."""
    return _FP8Linears.apply(x, backend, fp8_wgrad, cache_weight, weight, bias)


def fp8_linears(x: torch.Tensor, weights, biases=None, *, backend: str = "auto",
                fp8_wgrad: bool = True, cache_weight: bool = False) -> tuple[torch.Tensor, ...]:
    """``tuple(F.linear(x, w, b) for w, b in zip(weights, biases))`` as one group: ``x``
    quantised once, one GEMM of each kind (see the module docstring). Every weight's row count
    must be a multiple of 128 when there are several."""
    weights = list(weights)
    biases = list(biases) if biases is not None else [None] * len(weights)
    if len(biases) != len(weights):
        raise ValueError(f"fp8_linears: {len(weights)} weights but {len(biases)} biases")
    if not groupable([w.shape[0] for w in weights]):
        raise ValueError("fp8_linears: grouped weights need row counts that are multiples of 128, got "
                         f"{[w.shape[0] for w in weights]}")
    out = _FP8Linears.apply(x, backend, fp8_wgrad, cache_weight, *weights, *biases)
    return out if isinstance(out, tuple) else (out,)


class FP8Linear(nn.Linear):
    """An ``nn.Linear`` whose matmuls run in FP8. Built from an existing ``nn.Linear`` and
    holding *its* ``weight`` / ``bias`` Parameters (same objects, same names), so optimizers,
    FSDP, checkpoints and ``isinstance(m, nn.Linear)`` see no difference. ``cache_weight``: the
    forward's weight blocks come from ``weight_cache.CACHE`` (the module docstring)."""

    def __init__(self, linear: nn.Linear, backend: str = "auto", fp8_wgrad: bool = True,
                 cache_weight: bool = False) -> None:
        nn.Module.__init__(self)  # nn.Linear.__init__ would allocate fresh parameters
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)
        self.backend = backend
        self.fp8_wgrad = fp8_wgrad
        self.cache_weight = cache_weight
        self.train(linear.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, backend=self.backend, fp8_wgrad=self.fp8_wgrad,
                          cache_weight=self.cache_weight)

    @staticmethod
    def forward_group(x: torch.Tensor, modules) -> tuple[torch.Tensor, ...] | None:
        """The outputs of ``modules`` (FP8 linears of the same input) as one group, or ``None``
        where they cannot be one (another backend or weight dtype, a row count that is not a
        multiple of 128, a module hook that calling them one by one would run)."""
        first = modules[0]
        if not groupable([m.out_features for m in modules]) or any(
                m.backend != first.backend or m.fp8_wgrad != first.fp8_wgrad or m.weight.dtype != first.weight.dtype
                or m.cache_weight != first.cache_weight or m._forward_hooks or m._forward_pre_hooks for m in modules):
            return None
        return fp8_linears(x, [m.weight for m in modules], [m.bias for m in modules], backend=first.backend,
                           fp8_wgrad=first.fp8_wgrad, cache_weight=first.cache_weight)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, fp8={self.backend}" + ("" if self.fp8_wgrad else ", wgrad=high")
                + (", weight cached" if self.cache_weight else ""))
