"""liger-kernel's RMSNorm, SwiGLU and RoPE behind the call signatures a native model looks up
(``rmsnorm:liger``, ``swiglu:liger``, ``rope:liger``). Activations are tokens first, as in
``prime_plugin_custom.layers``; each function matches the eager code it replaces there.

liger is imported per call (a ``sys.modules`` lookup), so this module imports where liger is absent.
"""

from __future__ import annotations

import torch


def rmsnorm(x, weight, eps: float):
    """``RMSNorm.forward``: ``weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)``
    over the last dimension of ``x [..., H]`` (``weight [H]``); the output has ``x``'s dtype.
    liger's ``casting_mode="llama"`` is that order of casts."""
    from liger_kernel.transformers.functional import liger_rms_norm

    # in_place=True would write dX into dY; the residual stream hands the same dY to the skip
    # connection, which would then see the norm's gradient instead of its own.
    return liger_rms_norm(x, weight, eps, offset=0.0, casting_mode="llama", in_place=False)


def swiglu(gate, up):
    """``F.silu(gate) * up`` (the MLP's activation, between ``gate_proj``/``up_proj`` and
    ``down_proj``); ``gate`` and ``up`` have one shape and dtype."""
    from liger_kernel.transformers.functional import liger_swiglu

    return liger_swiglu(gate, up)


def rope(q, k, cos, sin):
    """``(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin))``: q ``[L, Hq, D]``, k ``[L, Hkv, D]``
    rotated by ``cos, sin [L, D]`` (one row per token, the half-split layout of transformers);
    returns new tensors of q's and k's shapes. The rotation runs in ``cos``'s dtype."""
    from liger_kernel.transformers.functional import liger_rope

    # liger rotates in place, in the [batch, tokens, heads, D] memory behind its [batch, heads,
    # tokens, D] arguments. Private copies keep the caller's q and k (and whatever autograd
    # saved of them) intact.
    q_rows = q.unsqueeze(0).clone(memory_format=torch.contiguous_format)
    k_rows = k.unsqueeze(0).clone(memory_format=torch.contiguous_format)
    out = liger_rope(q_rows.transpose(1, 2), k_rows.transpose(1, 2), cos.unsqueeze(0), sin.unsqueeze(0))
    # Some liger releases also return cos and sin.
    return out[0].transpose(1, 2)[0], out[1].transpose(1, 2)[0]
