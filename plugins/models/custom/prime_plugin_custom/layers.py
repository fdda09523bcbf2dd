"""The dense building blocks: RMSNorm, rotary embedding, attention (with its swappable kernel)
and the SwiGLU MLP. Activations are tokens first (``[L, H]``): a packed row is one sequence."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from prime_core.trainer.packing import PACKED_ROWS_OUTSIDE_GRAPHS, Packing, allowed


class RMSNorm(nn.Module):
    norm_fn = None
    """``norm_fn(x, weight, eps)``: a registered ``rmsnorm`` kernel (``trainer.model.kernels``)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm_fn is not None:
            return self.norm_fn(x, self.weight, self.eps)
        # As transformers: normalise in float32, round to the input dtype, then scale.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def inv_frequencies(rope: dict, dim: int) -> torch.Tensor:
    """``[dim / 2]`` float32 rotary inverse frequencies for a ``default``, ``linear`` or
    ``llama3`` rope (``families.rope_parameters``)."""
    base = float(rope["rope_theta"])
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = rope["rope_type"]
    if kind == "linear":
        return inv / float(rope["factor"])
    if kind == "llama3":
        factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        context = float(rope["original_max_position_embeddings"])
        wavelength = 2 * math.pi / inv
        # Long wavelengths are slowed down by `factor`, short ones kept, and the band between
        # the two cut-offs blends both linearly in context / wavelength.
        slowed = torch.where(wavelength > context / low, inv / factor, inv)
        blend = (context / wavelength - low) / (high - low)
        blended = (1 - blend) * slowed / factor + blend * slowed
        middle = (wavelength >= context / high) & (wavelength <= context / low)
        return torch.where(middle, blended, slowed)
    if kind != "default":
        raise ValueError(f"rope type {kind!r} is not implemented")
    return inv


class RotaryEmbedding(nn.Module):
    """``cos, sin`` ``[L, D]`` for the given positions.

    ``inv_freq`` is a non-persistent buffer: checkpoints do not hold it, a meta-device build
    has no values for it, so ``reset()`` recomputes it (the model calls it from ``to_empty``)."""

    def __init__(self, rope: dict, dim: int) -> None:
        super().__init__()
        self.rope = rope
        self.dim = dim
        self.register_buffer("inv_freq", inv_frequencies(rope, dim), persistent=False)

    def reset(self) -> None:
        # Computed on the CPU whatever the device, so every rank gets the same bits.
        with torch.device("cpu"):
            values = inv_frequencies(self.rope, self.dim)
        self.register_buffer("inv_freq", values.to(self.inv_freq.device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq.float()[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[L, heads, D]`` rotated by position (the half-split layout of transformers)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def _sdpa(q, k, v, scale, *, mask=None, causal=False):
    # [L, H, D] -> [1, H, L, D]. The flash kernel takes grouped kv heads as they are; the
    # others would fall back to the math kernel with enable_gqa, so kv is repeated for them.
    q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    if gqa and not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and mask is None):
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        gqa = False
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing, scale: float) -> torch.Tensor:
    """The default attention kernel: ``q [L, Hq, D]``, ``k, v [L, Hkv, D]`` -> ``[L, Hq, D]``,
    causal within each sample of ``packing`` and blocked across samples.

    A whole row runs one causal ``scaled_dot_product_attention`` per sample (the fast kernels,
    no ``L x L`` mask); a context-parallel subset of a row gets the mask from ``allowed``."""
    if packing.contiguous:
        if packing.single_sample():
            return _sdpa(q, k, v, scale, causal=True)
        return _per_sample(q, k, v, packing, scale)
    mask = allowed(packing.index, packing.segment_ids, packing.index, packing.segment_ids)
    return _sdpa(q, k, v, scale, mask=mask)


# Outside compiled graphs: a graph holding the loop would hold the row's sample boundaries and be
# recompiled for every packing (an RL step brings new ones in every row), then, past dynamo's
# recompile limit, run eagerly.
@torch.compiler.disable(reason=PACKED_ROWS_OUTSIDE_GRAPHS)
def _per_sample(q, k, v, packing, scale: float) -> torch.Tensor:
    return torch.cat([_sdpa(q[s:e], k[s:e], v[s:e], scale, causal=True) for s, e in packing.segments()])


sdpa_attention.prepare = Packing.single_sample
"""Called by the model once per forward, before the (compiled) blocks: the one-sample flag (the
boundaries: one host sync), which a compiled block then reads as a constant."""


def project(x: torch.Tensor, *linears: nn.Module) -> tuple[torch.Tensor, ...]:
    """``tuple(linear(x) for linear in linears)``, or one call computing them together where
    their class offers it: ``forward_group(x, linears)`` returning the outputs, or ``None``
    when these cannot be grouped (the fp8 plugin's FP8 linears: ``x`` quantised once, one wider
    GEMM)."""
    group = getattr(type(linears[0]), "forward_group", None)
    if group is not None and all(type(linear) is type(linears[0]) for linear in linears):
        outs = group(x, linears)
        if outs is not None:
            return outs
    return tuple(linear(x) for linear in linears)


class Attention(nn.Module):
    """Grouped-query attention. ``attention_fn(q, k, v, packing, scale)`` is the kernel;
    context-parallel strategies replace it, so it is only ever called through the attribute."""

    rope_fn = None
    """``rope_fn(q, k, cos, sin) -> (q, k)``: a registered ``rope`` kernel (``trainer.model.kernels``)."""
    grouped_projections = (("q_proj", "k_proj", "v_proj"),)
    """Linears of one input that ``forward`` calls together (``project``): what a plugin's
    memory model (``prime plan``) needs to know of them."""

    def __init__(self, *, hidden: int, heads: int, kv_heads: int, head_dim: int, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool, eps: float, attention_fn) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=o_bias)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps)
            self.k_norm = RMSNorm(head_dim, eps)
        else:
            self.q_norm = self.k_norm = None
        self.attention_fn = attention_fn

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, packing) -> torch.Tensor:
        length = x.shape[0]
        q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        q = q.view(length, self.heads, self.head_dim)
        k = k.view(length, self.kv_heads, self.head_dim)
        v = v.view(length, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_fn is not None:
            q, k = self.rope_fn(q, k, cos, sin)
        else:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.attention_fn(q, k, v, packing, self.scale)
        return self.o_proj(out.reshape(length, self.heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    swiglu_fn = None
    """``swiglu_fn(gate, up)``: a registered ``swiglu`` kernel (``trainer.model.kernels``)."""
    grouped_projections = (("gate_proj", "up_proj"),)
    """As ``Attention.grouped_projections``."""

    def __init__(self, hidden: int, intermediate: int, *, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(x, self.gate_proj, self.up_proj)
        return self.down_proj(self.swiglu_fn(gate, up) if self.swiglu_fn is not None else F.silu(gate) * up)
