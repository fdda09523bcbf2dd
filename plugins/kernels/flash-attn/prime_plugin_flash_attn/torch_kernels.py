"""Attention kernels that ship inside torch's CUDA builds, behind the
``attention_fn(q, k, v, packing, scale)`` contract: no package to install.

``torch_flash``: flash-attention 2's varlen kernel (the one behind SDPA's flash backend, with
sequence boundaries), one call per packed row.

``torch_fused``: the fastest of them per row. A row holding one sample runs cuDNN's fused
attention (on an H200 at 8k-32k tokens, head dim 128: 1.7x flash-attention 2's speed, forward
and backward), padded to a multiple of 256 tokens, traced into a compiled block like any op;
a packed row runs ``torch_flash`` (one varlen call instead of one SDPA call per sample: 2.4x at
8 samples of 1k).
"""

from __future__ import annotations

import functools

import torch

from prime_core.trainer.packing import PACKED_ROWS_OUTSIDE_GRAPHS, Packing
from prime_plugin_flash_attn.varlen import check_inputs, cu_seqlens, whole_row


@functools.cache
def _flash_function():
    class TorchFlashVarlen(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, cu, max_len, scale):
            out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
                q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scale)
            ctx.save_for_backward(q, k, v, out, lse, cu, rng_state, unused)
            ctx.max_len, ctx.scale = max_len, scale
            return out

        @staticmethod
        def backward(ctx, grad):
            q, k, v, out, lse, cu, rng_state, unused = ctx.saved_tensors
            dq, dk, dv = torch.ops.aten._flash_attention_backward(
                grad.contiguous(), q, k, v, out, lse, cu, cu, ctx.max_len, ctx.max_len, 0.0, True, rng_state, unused,
                scale=ctx.scale)
            return dq, dk, dv, None, None, None

    return TorchFlashVarlen


# Outside any compiled graph: the sample boundaries (and the longest sample, a Python int)
# change every step, and a graph holding them would be recompiled for each new packing.
@torch.compiler.disable(reason=PACKED_ROWS_OUTSIDE_GRAPHS)
def torch_flash(q, k, v, packing, scale):
    """``attention:torch_flash``: q ``[L, Hq, D]``, k/v ``[L, Hkv, D]`` -> ``[L, Hq, D]``, causal
    within each sample of ``packing``; grouped kv heads as they are."""
    whole_row(packing, "torch_flash")
    check_inputs(q, k, v, "torch_flash")
    if q.shape[0] == 0:
        return q.new_empty(q.shape)
    cu, max_len = cu_seqlens(packing)
    q, k, v = (t.contiguous() for t in (q, k, v))
    return _flash_function().apply(q, k, v, cu.to(q.device), max_len, float(scale))


CUDNN_LENGTH_MULTIPLE = 256
"""cuDNN runs a row of one sample padded at its end to a multiple of this many tokens. It builds
an execution plan for each new sequence length, forward and backward, and an RL step's rows bring
new lengths every step; padded, a run meets at most ``seq_len / 256`` of them. Causal attention
leaves the real tokens exact: none attends to a later position, and the padding's outputs are
dropped (their gradients zero)."""

CUDNN_PADDED_BELOW = 65536
"""Rows of this many tokens or more run at their own length: there a plan costs a few percent of
the row's attention, and the padded copies of q, k and v would be GiBs (8 at 1,048,576 tokens)."""


def cudnn_causal(q, k, v, scale):
    """One sample's causal attention through cuDNN (``[L, H, D]`` in and out). cuDNN takes
    grouped kv heads as they are from 9.19 on (``GQA_CUDNN``); before, only repeated."""
    if k.shape[1] != q.shape[1] and not cudnn_takes_grouped_heads():
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    length = q.shape[0]
    # A compiled block pads by 0 too where the length is a multiple already: a branch on the pad
    # would guard a symbolic length on it, a graph more. Eager, a multiple is not copied.
    if length < CUDNN_PADDED_BELOW and (torch.compiler.is_compiling() or length % CUDNN_LENGTH_MULTIPLE):
        q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, 0, 0, -length % CUDNN_LENGTH_MULTIPLE)) for t in (q, k, v))
    q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, q.requires_grad or k.requires_grad or v.requires_grad, 0.0, True, False, scale=scale)[0]
    return out[0, :, :length].transpose(0, 1)


GQA_CUDNN = 91900
"""The first cuDNN that takes fewer kv heads than query heads. Repeating them costs the 2.9B MoE
shape's step on an H200 1.1% (the copies forward, their gradients' sums backward; 0.9 GiB more
at the peak), where stop 47 timed a layer alone slightly faster with them repeated."""


# A constant to dynamo: called in a compiled block, ``torch.backends.cudnn.version()`` is a graph
# break ("torch.* op returned non-Tensor"), which split every block in two, and ran a whole
# checkpointed block eagerly.
@torch.compiler.assume_constant_result
def cudnn_takes_grouped_heads() -> bool:
    return (torch.backends.cudnn.version() or 0) >= GQA_CUDNN


def torch_fused(q, k, v, packing, scale):
    """``attention:torch_fused``: cuDNN for a row of one sample, ``torch_flash`` for a packed row."""
    whole_row(packing, "torch_fused")
    check_inputs(q, k, v, "torch_fused")
    if q.shape[0] and packing.single_sample():
        return cudnn_causal(q, k, v, float(scale))
    return torch_flash(q, k, v, packing, scale)


# Called once per forward by the native model, outside compiled blocks (see ``varlen``).
torch_flash.prepare = cu_seqlens
torch_fused.prepare = Packing.single_sample  # the flag a compiled block reads
