"""The ring's block kernel with cuDNN's fused attention where a part allows it, flash elsewhere.

The flash block kernel's plan (``flash_block``) splits each block into parts; a part that is
one sequence, unmasked or causal over as many keys as queries, runs cuDNN's fused attention
(``aten._scaled_dot_product_cudnn_attention`` and its backward, which return and take the
log-sum-exp like flash's): under the zigzag split that is every part of a row holding one
sample, except a diagonal block's joined call (its causal mask is aligned to the bottom right,
which cuDNN's is not), and those parts go to flash. On an H200 at 8k-32k tokens, head dim 128,
cuDNN's kernel runs 1.7x flash-attention 2's speed, forward and backward.

cuDNN takes grouped key/value heads only repeated: they are repeated per part, and their
gradients summed back over each group.
"""

from __future__ import annotations

import functools

from prime_plugin_cp.flash_block import FlashBlocks, Part, make_kernel, unavailable


def cudnn_fits(part: Part) -> bool:
    """Whether cuDNN runs ``part``: one sequence, and causal only over as many keys as queries."""
    single = len(part.cu_q) == 2 and len(part.cu_k) == 2
    return single and (not part.causal or part.cu_q == part.cu_k)


def _heads(x):
    """``[n, H, D]`` -> ``[1, H, n, D]`` (a view: cuDNN takes the strides)."""
    return x.transpose(0, 1)[None]


def _repeated(kv, heads: int):
    return kv if kv.shape[1] == heads else kv.repeat_interleave(heads // kv.shape[1], dim=1)


def _summed(grad, kv_heads: int):
    """A repeated key/value head's gradient ``[n, Hq, D]`` summed back over its group."""
    n, heads, dim = grad.shape
    return grad if heads == kv_heads else grad.view(n, kv_heads, heads // kv_heads, dim).sum(2)


def cudnn_forward_part(q, k, v, part: Part, scale):
    """``(out [n, Hq, D] in q's dtype, lse [Hq, n] float32)``, as ``flash_forward_part``."""
    if not cudnn_fits(part):
        return FlashBlocks.forward(q, k, v, part, scale)
    import torch

    heads = q.shape[1]
    out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        _heads(q), _heads(_repeated(k, heads)), _heads(_repeated(v, heads)), None, True, 0.0, part.causal, False,
        scale=scale)
    return out[0].transpose(0, 1), lse.reshape(heads, q.shape[0])


def cudnn_backward_part(dout, q, k, v, out, lse, part: Part, scale):
    """``(dq, dk, dv)`` of one part from the final output and log-sum-exp ``lse [Hq, n]``."""
    if not cudnn_fits(part):
        return FlashBlocks.backward(dout, q, k, v, out, lse, part, scale)
    import torch

    heads, kv_heads = q.shape[1], k.shape[1]
    seed = _no_dropout_seed(q.device)  # read only with dropout
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        _heads(dout), _heads(q), _heads(_repeated(k, heads)), _heads(_repeated(v, heads)), _heads(out),
        lse.reshape(1, heads, q.shape[0], 1), seed, seed, None, None, None, q.shape[0], k.shape[0], 0.0,
        part.causal, scale=scale)
    return dq[0].transpose(0, 1), _summed(dk[0].transpose(0, 1), kv_heads), _summed(dv[0].transpose(0, 1), kv_heads)


@functools.cache
def _no_dropout_seed(device):
    import torch

    return torch.zeros((), dtype=torch.int64, device=device)


class CudnnBlocks:
    forward = staticmethod(cudnn_forward_part)
    backward = staticmethod(cudnn_backward_part)


CUDNN = make_kernel(CudnnBlocks)


def cudnn_unavailable(q) -> str | None:
    """Why this kernel cannot run on ``q`` (``None`` when it can): flash's conditions (its
    fallback) and cuDNN's attention (enabled in torch, head dim up to 128)."""
    reason = unavailable(q)
    if reason is not None:
        return reason
    import torch

    if not torch.backends.cuda.cudnn_sdp_enabled():
        return "torch's cuDNN attention is disabled (torch.backends.cuda.enable_cudnn_sdp)"
    if q.shape[-1] > 128:
        return f"cuDNN's attention takes head dims up to 128 here, not {q.shape[-1]}"
    return None
