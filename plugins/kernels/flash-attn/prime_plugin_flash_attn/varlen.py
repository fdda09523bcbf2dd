"""flash-attention's varlen kernels behind the ``attention_fn(q, k, v, packing, scale)`` contract
of ``prime_core.trainer.packing``: a packed row is one varlen batch whose sequences are the
row's samples, so causal attention within each sample is flash-attention's own ``causal=True``
and nothing crosses a sample boundary.

Only whole rows (``packing.contiguous``) are taken: see ``whole_row``.
"""

from __future__ import annotations

import torch

from prime_plugin_flash_attn.plugin import FA4_HEAD_DIMS

_CACHE = "flash_attn_cu_seqlens"
DTYPES = (torch.bfloat16, torch.float16)


def cu_seqlens(packing) -> tuple[torch.Tensor, int]:
    """``(cu [S + 1] int32, max_len)`` for a contiguous packing of S samples: ``cu[i]`` is where
    sample ``i`` starts, ``cu[S]`` the row length, ``max_len`` the longest sample (0 for an
    empty row, whose ``cu`` is ``[0]``).

    From ``packing.segments()`` (the host's sample starts, or one read from the device), kept on
    the packing: every layer of a forward pass sees the same packing object."""
    cached = packing.cache.get(_CACHE)
    if cached is not None:
        return cached
    if not packing.contiguous:
        raise ValueError(f"cu_seqlens needs the whole row; this packing holds {packing.index.numel()} of its "
                         f"{packing.length} tokens (a context-parallel subset)")
    device = packing.segment_ids.device
    if packing.length == 0:
        result = (torch.zeros(1, dtype=torch.int32, device=device), 0)
    else:
        segments = packing.segments()
        bounds = torch.tensor([start for start, _ in segments] + [packing.length], dtype=torch.int32)
        if device.type == "cuda":  # pinned and asynchronous: a pageable copy waits for the queued kernels
            bounds = bounds.pin_memory().to(device, non_blocking=True)
        result = (bounds.to(device), max(end - start for start, end in segments))
    packing.cache[_CACHE] = result
    return result


def whole_row(packing, name: str) -> None:
    """Refuse a context-parallel subset of a row. The ``cp`` strategy never hands one to the
    model's kernel (``ring`` runs its own block kernel, ``ulysses`` gathers whole rows first),
    so one arriving here is a wiring error; masking it densely would hide that behind an
    ``L x L`` mask."""
    if not packing.contiguous:
        raise ValueError(
            f"attention:{name} takes whole packed rows, but this packing holds {packing.index.numel()} of the row's "
            f"{packing.length} tokens (a context-parallel subset). Run context parallelism through the cp strategy "
            "(trainer.model.cp > 1): cp_style = 'ulysses' hands this kernel whole rows, cp_style = 'ring' uses its "
            "own block kernel")


def check_inputs(q, k, v, name: str) -> None:
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"attention:{name} needs q [L, Hq, D] and k, v [L, Hkv, D]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"attention:{name}: {q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value "
                         "heads")
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"attention:{name} runs in bfloat16 or float16, got q {q.dtype}, k {k.dtype}, v {v.dtype}; "
                        "set trainer.model.dtype = 'bfloat16', or trainer.model.attn = 'sdpa' for float32")


def _varlen(fn, q, k, v, packing, scale, name: str):
    whole_row(packing, name)
    check_inputs(q, k, v, name)
    if q.shape[0] == 0:
        return q.new_empty(q.shape)
    cu, max_len = cu_seqlens(packing)
    cu = cu.to(q.device)
    out = fn(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len,
             softmax_scale=float(scale), causal=True)
    # flash-attn 3 betas returned (out, softmax_lse) unconditionally; later ones only on request.
    return out[0] if isinstance(out, tuple) else out


def flash_attention_2(q, k, v, packing, scale):
    """``attention:flash_attention_2``: ``flash_attn.flash_attn_varlen_func`` over the samples of
    ``packing`` (GQA: kv heads as they are). q ``[L, Hq, D]``, k/v ``[L, Hkv, D]`` -> ``[L, Hq, D]``."""
    from flash_attn import flash_attn_varlen_func

    return _varlen(flash_attn_varlen_func, q, k, v, packing, scale, "flash_attention_2")


def flash_attention_3(q, k, v, packing, scale):
    """``attention:flash_attention_3``: flash-attention 3's ``flash_attn_interface.flash_attn_varlen_func``
    (Hopper), same contract as ``flash_attention_2``."""
    from flash_attn_interface import flash_attn_varlen_func

    return _varlen(flash_attn_varlen_func, q, k, v, packing, scale, "flash_attention_3")


# flash-attention 4's Python (its kernel configuration and JIT cache) is not traceable: the
# call stays out of compiled graphs, as ``torch_flash`` does.
@torch.compiler.disable(reason="prime: flash-attention 4's Python (kernel configuration, JIT cache) is not "
                               "traceable; it runs outside the compiled block, so trainer.model.compile.fullgraph = "
                               "true cannot be used with it")
def flash_attention_4(q, k, v, packing, scale):
    """``attention:flash_attention_4``: flash-attention 4's CuTe DSL kernels (``flash_attn.cute``,
    Hopper and Blackwell), same contract as ``flash_attention_2``, at the head dims of
    ``FA4_HEAD_DIMS``. A row of one sample runs the fixed-length kernel (batch of one), a packed
    row the varlen one."""
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    whole_row(packing, "flash_attention_4")
    check_inputs(q, k, v, "flash_attention_4")
    if q.shape[-1] not in FA4_HEAD_DIMS:
        raise ValueError(f"attention:flash_attention_4 is checked at head dims {', '.join(map(str, FA4_HEAD_DIMS))}; "
                         f"this model's is {q.shape[-1]} (flash-attn-4's Hopper backward gave wrong gradients at "
                         "16): set trainer.model.attn = 'torch_fused'")
    if q.shape[0] and packing.single_sample():
        out = flash_attn_func(q[None], k[None], v[None], softmax_scale=float(scale), causal=True)
        return (out[0] if isinstance(out, tuple) else out)[0]
    return _varlen(flash_attn_varlen_func, q, k, v, packing, scale, "flash_attention_4")


# The native model calls ``attention_fn.prepare(packing)`` once per forward, outside compiled
# blocks, so that the host sync of ``cu_seqlens`` does not happen inside the first layer's graph.
flash_attention_2.prepare = cu_seqlens
flash_attention_3.prepare = cu_seqlens
flash_attention_4.prepare = cu_seqlens
