"""``lm_head:liger``: per-token log-probabilities from liger's fused linear cross-entropy, for SFT.

The core's LM-head contract (``lm_head:fused``) is ``(hidden, weight, targets, temperature, *,
token_chunk, vocab_chunk, with_entropy) -> (logp [N], entropy [N] | None)``. liger can give
``logp`` (``-loss`` with ``reduction="none"``) but no entropy, and in liger releases before its
fix of ``reduction="none"`` (linkedin/Liger-Kernel#1298) the backward pass scales every token's
gradient by the first token's upstream gradient. So here:

- the forward pass asks liger for the per-token losses without gradients;
- the backward pass asks liger again with ``reduction="sum"`` (correct in every release), the
  tokens whose upstream gradient is 0 set to ``ignore_index``, and scales by the one nonzero
  upstream gradient. That is exactly SFT's ``sum(-logp * loss_mask) * scale``; an upstream
  gradient with several nonzero values (the RL loss's advantages) is refused.
- ``with_entropy=True`` is refused: the RL trainer asks for it, so RL uses ``lm_head:fused``.
"""

from __future__ import annotations

import torch

IGNORE = -100


def _flce(hidden, weight, targets, reduction: str):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    loss = liger_fused_linear_cross_entropy(hidden, weight, targets, ignore_index=IGNORE, reduction=reduction)
    # Releases differ in what comes back beside the loss when extras are requested; none are here.
    return loss[0] if isinstance(loss, tuple) else loss


class _LigerLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets):
        with torch.no_grad():
            loss = _flce(hidden.detach(), weight.detach(), targets, "none")
        ctx.save_for_backward(hidden, weight, targets)
        return -loss.float()

    @staticmethod
    def backward(ctx, grad_logp):
        hidden, weight, targets = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        live = grad_logp != 0
        weights = grad_logp[live]
        if weights.numel() == 0 or not (need_hidden or need_weight):
            return (torch.zeros_like(hidden) if need_hidden else None,
                    torch.zeros_like(weight) if need_weight else None, None)
        common = weights[0]
        if not bool((weights == common).all()):
            raise RuntimeError(
                "lm_head:liger: the loss weights tokens unequally (e.g. RL advantages); liger's fused linear "
                "cross-entropy only gives correct gradients for a masked sum of log-probabilities (SFT). Use the "
                "lm_head:fused kernel for this loss")
        with torch.enable_grad():
            h = hidden.detach().requires_grad_(need_hidden)
            w = weight.detach().requires_grad_(need_weight)
            loss = _flce(h, w, torch.where(live, targets, IGNORE), "sum")
            wanted = [t for t in (h, w) if t.requires_grad]
            # d(sum_i g_i logp_i) = -g d(sum_live loss_i) when every live g_i equals g.
            grads = iter(torch.autograd.grad(loss, wanted, grad_outputs=(-common).to(loss.dtype)))
        return (next(grads) if need_hidden else None), (next(grads) if need_weight else None), None


def liger_logprobs(hidden, weight, targets, temperature=1.0, *, token_chunk="auto", vocab_chunk=None,
                   with_entropy=True):
    """``(log p(targets) [N] float32, None)`` under ``softmax(hidden @ weight.T / temperature)``.

    ``hidden [N, H]`` and ``weight [V, H]`` share a dtype; ``targets [N]`` int64 in ``[0, V)``;
    ``temperature`` a float or ``N`` per-token values (applied to ``hidden``, which scales the
    logits the same way). ``token_chunk``/``vocab_chunk`` are accepted for the contract and
    ignored: liger sizes its own chunks. Gradients: see the module docstring."""
    if with_entropy:
        raise ValueError(
            "lm_head:liger computes no entropy (liger's fused linear cross-entropy returns only the loss); the RL "
            "trainer needs it, so use the lm_head:fused kernel there; lm_head:liger serves SFT (with_entropy=False)")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"lm_head:liger: hidden must be [N, H] and weight [V, H], got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"lm_head:liger: hidden is {hidden.dtype} but weight is {weight.dtype}")
    if targets.shape != hidden.shape[:1] or targets.dtype != torch.int64:
        raise ValueError(f"lm_head:liger: targets must be int64 of shape ({hidden.shape[0]},), got "
                         f"{targets.dtype} {tuple(targets.shape)}")
    if hidden.shape[0] == 0:  # liger divides by the token count when it sizes its chunks
        return hidden[:, 0].float() * 0, None
    if isinstance(temperature, torch.Tensor):
        scale = temperature.detach().to(device=hidden.device, dtype=hidden.dtype).reshape(-1, 1)
        hidden = hidden / scale
    elif float(temperature) != 1.0:
        hidden = hidden / float(temperature)
    return _LigerLogProbs.apply(hidden, weight, targets.contiguous()), None
