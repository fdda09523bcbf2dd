"""Optimizer and learning-rate schedule from ``optim`` / ``scheduler`` config."""

from __future__ import annotations

import math


def build_optimizer(model, optim_config):
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    if optim_config.type == "sgd":
        return torch.optim.SGD(params, lr=optim_config.lr, weight_decay=optim_config.weight_decay)
    return torch.optim.AdamW(params, lr=optim_config.lr, weight_decay=optim_config.weight_decay,
                             betas=tuple(optim_config.betas))


def build_scheduler(optimizer, scheduler_config, max_steps: int | None):
    import torch

    warmup = scheduler_config.warmup_steps
    total = max_steps or 0

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if scheduler_config.type == "constant" or total <= warmup:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if scheduler_config.type == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def clip_and_step(model, optimizer, scheduler, max_norm: float | None) -> float:
    import torch

    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else float("inf"))
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)
