"""``fp8_linear``: ``y = x @ W.T + b`` with all three GEMMs of training in block-scaled FP8.

- forward ``y = x @ W.T``: ``x`` 1×128 along K, ``W`` 128×128.
- input gradient ``dx = dy @ W``: ``dy`` 1×128 along N, ``W.T`` 128×128 (the same blocks as
  ``W``'s, re-quantised from the high-precision weight rather than kept from the forward:
  keeping it would hold an FP8 copy of every weight from the forward to the backward).
- weight gradient ``dW = dy.T @ x`` (``fp8_wgrad=True``, as DeepSeek-V3 and Transformer
  Engine do): ``dy.T`` and ``x.T`` each 1×128 along the token dimension, float32 result.
  ``fp8_wgrad=False`` computes it in the inputs' precision instead (a plain matmul).

Saved for the backward, only what a gradient needs: for the weight's, ``x.T`` already
quantised along the tokens (its FP8 operand, which the forward's one pass over ``x``
produces beside the forward's own; a byte a value, where a bf16 ``x`` takes two), or ``x`` in its own
precision under ``fp8_wgrad=False``; for the input's, ``W`` (the parameter itself). The
backward quantises ``dy`` for both its GEMMs in one pass too. The bias is added, and its
gradient summed, in high precision. Master weights are untouched: only the GEMM operands are
FP8. Output and ``dx`` have ``x``'s dtype, ``dW`` the weight's.
"""

from __future__ import annotations

import torch
from torch import nn

from prime_plugin_fp8.gemm import gemm
from prime_plugin_fp8.quant import BLOCK, FP8, padded, quantize_blocks, quantize_rows, quantize_rows_and_columns

# The three GEMMs as custom operators: to torch.compile each is one opaque node, so a compiled
# block keeps one graph around its FP8 linears (tracing into the quantisers' kernel launches
# and the backends' dispatch broke it at every linear: the 1.7B step spent 600 ms on the host
# for 240 ms of GPU work).


@torch.library.custom_op("prime_fp8::forward_gemm", mutates_args=())
def _forward_gemm(x: torch.Tensor, weight: torch.Tensor, backend: str) -> torch.Tensor:
    """``x @ weight.T``: ``x`` 1×128 along K, ``weight`` 128×128."""
    return gemm(quantize_rows(x), quantize_blocks(weight), b_block=128, out_dtype=x.dtype, backend=backend)


@_forward_gemm.register_fake
def _(x, weight, backend):
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op("prime_fp8::forward_gemm_keeping_xt", mutates_args=())
def _forward_gemm_keeping_xt(x: torch.Tensor, weight: torch.Tensor,
                             backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x @ weight.T``, and ``x.T`` quantised 1×128 along the tokens for the weight gradient."""
    rows, (xt, xt_scale) = quantize_rows_and_columns(x)
    return gemm(rows, quantize_blocks(weight), b_block=128, out_dtype=x.dtype, backend=backend), xt, xt_scale


@_forward_gemm_keeping_xt.register_fake
def _(x, weight, backend):
    m, k = x.shape
    return (x.new_empty((m, weight.shape[0])), x.new_empty((k, padded(m)), dtype=FP8),
            x.new_empty((k, padded(m) // BLOCK), dtype=torch.float32))


@torch.library.custom_op("prime_fp8::input_grad_gemm", mutates_args=())
def _input_grad_gemm(g: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype, backend: str) -> torch.Tensor:
    """``g @ weight``: ``g`` 1×128 along N, ``weight.T`` 128×128."""
    return gemm(quantize_rows(g), quantize_blocks(weight.t()), b_block=128, out_dtype=out_dtype, backend=backend)


@_input_grad_gemm.register_fake
def _(g, weight, out_dtype, backend):
    return g.new_empty((g.shape[0], weight.shape[1]), dtype=out_dtype)


@torch.library.custom_op("prime_fp8::weight_grad_gemm", mutates_args=())
def _weight_grad_gemm(g: torch.Tensor, xt: torch.Tensor, xt_scale: torch.Tensor, out_dtype: torch.dtype,
                      backend: str) -> torch.Tensor:
    """``g.T @ x``: both 1×128 along the token dimension (``x.T`` quantised in the forward)."""
    return gemm(quantize_rows(g.t()), (xt, xt_scale), b_block=1, out_dtype=out_dtype, backend=backend)


@_weight_grad_gemm.register_fake
def _(g, xt, xt_scale, out_dtype, backend):
    return g.new_empty((g.shape[1], xt.shape[0]), dtype=out_dtype)


@torch.library.custom_op("prime_fp8::input_and_weight_grad_gemms", mutates_args=())
def _input_and_weight_grad_gemms(g: torch.Tensor, weight: torch.Tensor, xt: torch.Tensor, xt_scale: torch.Tensor,
                                 x_dtype: torch.dtype, w_dtype: torch.dtype,
                                 backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Both: ``g @ weight`` and ``g.T @ x``, from one quantising pass over ``g``."""
    rows, columns = quantize_rows_and_columns(g)
    grad_x = gemm(rows, quantize_blocks(weight.t()), b_block=128, out_dtype=x_dtype, backend=backend)
    return grad_x, gemm(columns, (xt, xt_scale), b_block=1, out_dtype=w_dtype, backend=backend)


@_input_and_weight_grad_gemms.register_fake
def _(g, weight, xt, xt_scale, x_dtype, w_dtype, backend):
    return (g.new_empty((g.shape[0], weight.shape[1]), dtype=x_dtype),
            g.new_empty((g.shape[1], xt.shape[0]), dtype=w_dtype))


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, backend: str, fp8_wgrad: bool):
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        needs_x, needs_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        xt = xt_scale = None
        if needs_w and fp8_wgrad:
            y, xt, xt_scale = _forward_gemm_keeping_xt(x2, weight, backend)
        else:
            y = _forward_gemm(x2, weight, backend)
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.save_for_backward(x2 if needs_w and not fp8_wgrad else None, xt, xt_scale,
                              weight if needs_x else None)
        ctx.backend, ctx.fp8_wgrad = backend, fp8_wgrad
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        return y.reshape(*lead, weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        x2, xt, xt_scale, weight = ctx.saved_tensors
        g = grad_y.reshape(-1, grad_y.shape[-1])
        needs_x, needs_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = grad_w = grad_b = None
        if needs_x and needs_w and ctx.fp8_wgrad:
            grad_x, grad_w = _input_and_weight_grad_gemms(g, weight, xt, xt_scale, ctx.x_dtype, ctx.w_dtype,
                                                          ctx.backend)
        elif needs_x:
            grad_x = _input_grad_gemm(g, weight, ctx.x_dtype, ctx.backend)
        if needs_w and grad_w is None:
            if ctx.fp8_wgrad:
                grad_w = _weight_grad_gemm(g, xt, xt_scale, ctx.w_dtype, ctx.backend)
            else:
                grad_w = (g.t().to(x2.dtype) @ x2).to(ctx.w_dtype)
        if grad_x is not None:
            grad_x = grad_x.reshape(ctx.x_shape)
        if ctx.b_dtype is not None and ctx.needs_input_grad[2]:
            grad_b = g.float().sum(0).to(ctx.b_dtype)
        return grad_x, grad_w, grad_b, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               backend: str = "auto", fp8_wgrad: bool = True) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed in block-scaled FP8 by ``backend`` (``auto``,
    ``deep_gemm``, ``torch``, ``emulated``); ``x [..., K]``, ``weight [N, K]``."""
    return _FP8Linear.apply(x, weight, bias, backend, fp8_wgrad)


class FP8Linear(nn.Linear):
    """An ``nn.Linear`` whose matmuls run in FP8. Built from an existing ``nn.Linear`` and
    holding *its* ``weight`` / ``bias`` Parameters (same objects, same names), so optimizers,
    FSDP, checkpoints and ``isinstance(m, nn.Linear)`` see no difference."""

    def __init__(self, linear: nn.Linear, backend: str = "auto", fp8_wgrad: bool = True) -> None:
        nn.Module.__init__(self)  # nn.Linear.__init__ would allocate fresh parameters
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)
        self.backend = backend
        self.fp8_wgrad = fp8_wgrad
        self.train(linear.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, backend=self.backend, fp8_wgrad=self.fp8_wgrad)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.backend}" + ("" if self.fp8_wgrad else ", wgrad=high")
