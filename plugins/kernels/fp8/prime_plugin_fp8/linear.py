"""``fp8_linear``: ``y = x @ W.T + b`` with all three GEMMs of training in block-scaled FP8.

- forward ``y = x @ W.T``: ``x`` 1×128 along K, ``W`` 128×128.
- input gradient ``dx = dy @ W``: ``dy`` 1×128 along N, ``W.T`` 128×128 (the same blocks as
  ``W``'s, re-quantised from the high-precision weight rather than kept from the forward:
  keeping it would hold an FP8 copy of every weight from the forward to the backward).
- weight gradient ``dW = dy.T @ x`` (``fp8_wgrad=True``, as DeepSeek-V3 and Transformer
  Engine do): ``dy.T`` and ``x.T`` each 1×128 along the token dimension, float32 result.
  ``fp8_wgrad=False`` computes it in the inputs' precision instead (a plain matmul).

Saved for the backward: ``x`` in its own precision (what ``nn.Linear`` saves; needed only
when ``W`` wants a gradient) and ``W`` (the parameter itself; only when ``x`` wants one).
The bias is added, and its gradient summed, in high precision. Master weights are untouched:
only the GEMM operands are FP8. Output and ``dx`` have ``x``'s dtype, ``dW`` the weight's.
"""

from __future__ import annotations

import torch
from torch import nn

from prime_plugin_fp8.gemm import gemm
from prime_plugin_fp8.quant import quantize_blocks, quantize_rows


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, backend: str, fp8_wgrad: bool):
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        y = gemm(quantize_rows(x2), quantize_blocks(weight), b_block=128, out_dtype=x.dtype, backend=backend)
        if bias is not None:
            y = y + bias.to(y.dtype)
        needs_x, needs_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.save_for_backward(x2 if needs_w else None, weight if needs_x else None)
        ctx.backend, ctx.fp8_wgrad = backend, fp8_wgrad
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        return y.reshape(*lead, weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        x2, weight = ctx.saved_tensors
        g = grad_y.reshape(-1, grad_y.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = gemm(quantize_rows(g), quantize_blocks(weight.t()), b_block=128, out_dtype=ctx.x_dtype,
                          backend=ctx.backend).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            if ctx.fp8_wgrad:
                grad_w = gemm(quantize_rows(g.t()), quantize_rows(x2.t()), b_block=1, out_dtype=ctx.w_dtype,
                              backend=ctx.backend)
            else:
                grad_w = (g.t().to(x2.dtype) @ x2).to(ctx.w_dtype)
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
