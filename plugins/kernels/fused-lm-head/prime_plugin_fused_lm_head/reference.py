"""The eager reference every ``lm_head:fused`` implementation is checked against: the full
logits in float64, ``log_softmax`` and a gather. Memory ``O(N * V)``: for tests only."""

from __future__ import annotations

import torch


def reference_logprobs(hidden, weight, targets, temperature=1.0):
    """``(logp [N], entropy [N])`` in float64, differentiable in ``hidden`` and ``weight``
    (through their float64 copies) for comparing gradients."""
    logits = hidden.double() @ weight.double().T
    if isinstance(temperature, torch.Tensor):
        logits = logits / temperature.double().reshape(-1, 1)
    else:
        logits = logits / float(temperature)
    logsm = torch.log_softmax(logits, dim=-1)
    logp = logsm.gather(1, targets[:, None])[:, 0]
    entropy = -(logsm.exp() * logsm).sum(-1)
    return logp, entropy
