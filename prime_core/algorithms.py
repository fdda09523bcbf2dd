"""The built-in advantage estimator and RL loss (registered by the ``core`` plugin).

Advantage estimators take the rewards of one group (the completions of one prompt) and
return one advantage per completion. Losses take per-token tensors of one micro-batch and
return the per-token loss plus per-token diagnostics; the trainer masks, sums and divides by
the number of loss tokens of the whole step (token-level normalisation).
"""

from __future__ import annotations


def grpo_advantages(rewards: list[float]) -> list[float]:
    """``r - mean(r)`` over the group (no division by the standard deviation)."""
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


def default_loss(logprobs, inference_logprobs, advantages, *, mask_threshold: float = 0.2, kl_tau: float = 1e-3,
                 adv_tau: float = 1.0, mask_low: float | None = None, mask_high: float | None = None):
    """Importance-weighted policy gradient with probability-difference masking.

    ``ratio = exp(logp - logp_inference)``; a token whose probability moved more than
    ``mask_threshold`` past the inference policy in the direction its advantage pushes is
    masked (``Δp > t`` when ``A > 0``, ``Δp < -t`` when ``A < 0``; prime-rl's ``mask_high`` and
    ``mask_low`` set the two sides apart). The loss per token is
    ``-keep · adv_tau · A · ratio + kl_tau · log_ratio²``.
    """
    import torch

    log_ratio = logprobs - inference_logprobs
    ratio = torch.exp(log_ratio)
    with torch.no_grad():
        delta_p = torch.exp(logprobs) - torch.exp(inference_logprobs)
        high = mask_threshold if mask_high is None else mask_high
        low = mask_threshold if mask_low is None else mask_low
        masked = ((advantages > 0) & (delta_p > high)) | ((advantages < 0) & (delta_p < -low))
        keep = (~masked).to(logprobs.dtype)
        mismatch_kl = ratio - log_ratio - 1
    loss = -keep * adv_tau * advantages * ratio + kl_tau * log_ratio**2
    return loss, {"mismatch_kl": mismatch_kl, "is_masked": masked.to(logprobs.dtype), "ratio": ratio.detach()}
