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
                 adv_tau: float = 1.0, mask_low: float | None = None, mask_high: float | None = None,
                 teacher_logprobs=None, teacher_tau: float = 0.0):
    """Importance-weighted policy gradient with probability-difference masking.

    ``ratio = exp(logp - logp_inference)``; a token whose probability moved more than
    ``mask_threshold`` past the inference policy in the direction its advantage pushes is
    masked (``Δp > t`` when ``A > 0``, ``Δp < -t`` otherwise; prime-rl's ``mask_high`` and
    ``mask_low`` set the two sides apart). The loss per token is
    ``-keep · A' · ratio + kl_tau · log_ratio²`` with ``A' = adv_tau · A``.

    With the teacher's log-probabilities of the tokens (on-policy distillation, prime-rl's
    ``teacher_tau``), ``A' = adv_tau · A + teacher_tau · (logp_teacher - logp)``, the second
    term detached: a per-token advantage that pushes each token toward the teacher's
    probability of it (a reverse-KL gradient; ``teacher_kl`` in the diagnostics). The mask
    still follows the sign of the reward advantage ``A``, as prime-rl 0.6's ``opd`` loss does.
    """
    import torch

    log_ratio = logprobs - inference_logprobs
    ratio = torch.exp(log_ratio)
    with torch.no_grad():
        delta_p = torch.exp(logprobs) - torch.exp(inference_logprobs)
        high = mask_threshold if mask_high is None else mask_high
        low = mask_threshold if mask_low is None else mask_low
        # As prime-rl 0.6: a token whose advantage is not positive is held to the low side (with a
        # teacher's term its reward advantage may be 0 and its whole advantage not).
        masked = torch.where(advantages > 0, delta_p > high, delta_p < -low)
        keep = (~masked).to(logprobs.dtype)
        mismatch_kl = ratio - log_ratio - 1
    extra = {}
    weight = adv_tau * advantages
    if teacher_logprobs is not None:
        teacher_kl = (teacher_logprobs - logprobs).detach()
        weight = weight + teacher_tau * teacher_kl
        extra["teacher_kl"] = teacher_kl
    loss = -keep * weight * ratio + kl_tau * log_ratio**2
    return loss, {"mismatch_kl": mismatch_kl, "is_masked": masked.to(logprobs.dtype), "ratio": ratio.detach(),
                  **extra}


def sft_loss(logprobs, inference_logprobs, advantages, **_):
    """Negative log-likelihood of the tokens (prime-rl 0.5's ``trainer.loss.type = "sft"``, and
    ``training_mode = "sft"``: the student imitates the teacher's rollouts)."""
    return -logprobs, {}
