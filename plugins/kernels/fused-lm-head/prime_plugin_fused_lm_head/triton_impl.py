"""``lm_head:fused_triton``: the chunked LM head with its softmax work in two Triton kernels.

The matmuls stay with cuBLAS (``hidden @ weight.T`` in the inputs' dtype, as in the PyTorch
implementation); what Triton replaces is everything between them, which in eager PyTorch
reads and writes several float32 copies of the ``[chunk, vocab]`` logits:

- ``stats``: one program per token streams its row of logits once, in float32 registers,
  and returns the online ``(max, Σ exp, Σ exp·(x − max))`` and the target's logit.
- ``grad``: one program per (token, block of columns) turns the recomputed logits into
  ``(onehot(target) − exp(x/T − lse)) · upstream / T`` in place, in the inputs' dtype,
  ready for the two gradient matmuls.

So a chunk holds one row of logits in the input dtype instead of two float32 rows
(``chunking.bytes_per_token(softmax_rows=0)``): at bf16 a quarter of the memory, or chunks
four times longer for the same budget. When ``"auto"`` keeps the logits
(``chunking.keeps_logits``), both kernels run once over all of them and the gradient is
written over the kept logits, so the backward pass is two matmuls. The numbers are the PyTorch implementation's (same
bf16 logits, same float32 softmax), which ``tests/test_triton_impl.py`` checks, with the
float64 reference, through Triton's interpreter on a CPU and compiled on a GPU.
"""

from __future__ import annotations

import functools
import os

import torch

from prime_plugin_fused_lm_head.torch_impl import fused_logprobs as _chunked

BLOCK = 2048
"""Columns a program handles per step; large enough to stream a 150k-entry row in ~75 steps."""


def unavailable_reason() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError:
        return "needs triton (pip install triton); lm_head:fused runs the PyTorch implementation without it"

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return "needs a CUDA GPU (or TRITON_INTERPRET=1, Triton's slow reference interpreter)"
    return None


def fused_logprobs(hidden, weight, targets, temperature=1.0, *, token_chunk, vocab_chunk=None, with_entropy=True):
    """``torch_impl.fused_logprobs`` with the Triton kernels; the same arguments and results."""
    reason = unavailable_reason()
    if reason:
        raise RuntimeError(f"lm_head:fused_triton {reason}")
    if hidden.dtype == torch.float64:
        raise ValueError("lm_head:fused_triton computes the softmax in float32; for float64 inputs use "
                         "lm_head:fused_torch")
    return _chunked(hidden, weight, targets, temperature, token_chunk=token_chunk, vocab_chunk=vocab_chunk,
                    with_entropy=with_entropy, blocks=TritonBlocks)


class TritonBlocks:
    softmax_rows = 0
    tensor_temperature = True  # the kernels read one temperature per token

    @staticmethod
    def stats(h, w, temperature, targets, start, with_entropy, logits=None):
        logits = _logits(h, w) if logits is None else logits
        rows, width = logits.shape
        dtype = torch.promote_types(h.dtype, torch.float32)
        m, s, target_logit = (torch.empty(rows, dtype=dtype, device=h.device) for _ in range(3))
        a = torch.empty_like(m) if with_entropy else m
        if rows:
            _kernels().stats[(rows,)](logits, logits.stride(0), temperature.contiguous(), targets.contiguous(),
                                      start, width,
                                      m, s, a, target_logit, WITH_ENTROPY=with_entropy, BLOCK=BLOCK)
        return (m, s, a if with_entropy else None), target_logit

    @staticmethod
    def grad(h, w, temperature, targets, start, lse, coef, logits=None):
        # Recomputed logits, or the forward's kept ones: either way overwritten in place.
        logits = _logits(h, w) if logits is None else logits
        rows, width = logits.shape
        if rows:
            grid = (rows, _cdiv(width, BLOCK))
            _kernels().grad[grid](logits, logits.stride(0), temperature.contiguous(), targets.contiguous(), start,
                                  width, lse.contiguous(), coef.contiguous(), BLOCK=BLOCK)
            # A kernel's store is invisible to autograd: say so, or a second backward would take
            # this gradient for the kept logits.
            torch.autograd.graph.increment_version(logits)
        return logits


def _logits(h, w):
    # A fresh [rows, width] tensor in the inputs' dtype; its rows are contiguous.
    return h @ w.T


def _cdiv(a, b):
    return -(-a // b)


@functools.cache
def _kernels():
    """Compiled on first use (under TRITON_INTERPRET=1, interpreted), so importing this module
    costs nothing and a CPU test can switch the interpreter on first."""
    import types

    import triton
    import triton.language as tl

    @triton.jit
    def stats(logits, stride, temperature, targets, start, width, m_out, s_out, a_out, target_out,
              WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits + row * stride
        inv_t = 1.0 / tl.load(temperature + row).to(tl.float32)
        # A finite start: exp(m - new_m) is then 0 and never 0 * inf on the first block.
        m = -1e30
        s = 0.0
        a = 0.0
        for col in range(0, width, BLOCK):
            cols = col + tl.arange(0, BLOCK)
            inside = cols < width
            x = tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32) * inv_t
            new_m = tl.maximum(m, tl.max(x, 0))
            scale = tl.exp(m - new_m)
            e = tl.exp(x - new_m)
            if WITH_ENTROPY:
                # Masked columns have e = 0; x - new_m would be -inf there.
                a = scale * (a + s * (m - new_m)) + tl.sum(e * tl.where(inside, x - new_m, 0.0), 0)
            s = s * scale + tl.sum(e, 0)
            m = new_m
        tl.store(m_out + row, m)
        tl.store(s_out + row, s)
        if WITH_ENTROPY:
            tl.store(a_out + row, a)
        target = tl.load(targets + row) - start
        here = (target >= 0) & (target < width)
        picked = tl.load(base + tl.where(here, target, 0)).to(tl.float32) * inv_t
        tl.store(target_out + row, tl.where(here, picked, 0.0))

    @triton.jit
    def grad(logits, stride, temperature, targets, start, width, lse, coef, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < width
        base = logits + row * stride
        inv_t = 1.0 / tl.load(temperature + row).to(tl.float32)
        c = tl.load(coef + row).to(tl.float32)
        x = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32) * inv_t
        g = -c * tl.exp(x - tl.load(lse + row).to(tl.float32))
        target = tl.load(targets + row) - start
        g = tl.where(cols == target, g + c, g)
        tl.store(base + cols, g.to(logits.dtype.element_ty), mask=inside)

    return types.SimpleNamespace(stats=stats, grad=grad)
