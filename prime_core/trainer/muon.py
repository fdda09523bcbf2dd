"""prime-rl's two other optimizers: ``muon`` and ``sign_sgd`` (``trainer.optim.type``).

``Muon``: momentum SGD whose update of each hidden weight matrix is orthogonalised by a
Newton-Schulz iteration (the update ``torch.optim.Muon`` makes, scaled by
``sqrt(max(1, rows/cols))``); every other trainable tensor (embeddings, the LM head, norms,
biases) is updated by AdamW, as Muon is meant to be used. One optimizer with two kinds of
param groups, so that checkpoints and the LR schedule treat it like any other. A sharded
(DTensor) matrix is gathered for the iteration, which needs the whole matrix, and its update
is applied to the local shard.

``SignSGD``: ``p -= lr * sign(grad)`` after decoupled weight decay; it keeps no state.
"""

from __future__ import annotations

import math

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5


def is_muon_matrix(name: str, param) -> bool:
    """Hidden weight matrices: 2-D and neither the token embeddings nor the LM head."""
    return param.ndim == 2 and "embed" not in name and "lm_head" not in name


def orthogonalise(matrix: torch.Tensor, steps: int = NS_STEPS, eps: float = 1e-7) -> torch.Tensor:
    """The quintic Newton-Schulz iteration towards ``U V^T`` of ``matrix = U S V^T`` (in bfloat16)."""
    a, b, c = NS_COEFFICIENTS
    x = matrix.bfloat16()
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _like(update: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``update`` (a whole matrix, the same on every rank) laid out as ``param`` is."""
    if not hasattr(param, "device_mesh"):
        return update
    from torch.distributed.tensor import DTensor, Replicate

    mesh = param.device_mesh
    whole = DTensor.from_local(update, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return whole.redistribute(mesh, param.placements)


class Muon(torch.optim.Optimizer):
    def __init__(self, named_params, *, lr: float, weight_decay: float, momentum: float = 0.95,
                 nesterov: bool = True, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        named = [(n, p) for n, p in named_params if p.requires_grad]
        matrices = [p for n, p in named if is_muon_matrix(n, p)]
        others = [p for n, p in named if not is_muon_matrix(n, p)]
        groups = [{"params": matrices, "muon": True}, {"params": others, "muon": False}]
        super().__init__([g for g in groups if g["params"]],
                         {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
                          "betas": tuple(betas), "eps": eps, "muon": False})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    (self._muon if group["muon"] else self._adamw)(param, group)
        return loss

    def _muon(self, param, group) -> None:
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param)
        buf, grad, mu = state["momentum_buffer"], param.grad, group["momentum"]
        buf.lerp_(grad, 1 - mu)
        update = grad.lerp(buf, mu) if group["nesterov"] else buf
        ortho = orthogonalise(_whole(update)).to(param.dtype)
        rows, cols = param.shape[:2]
        lr = group["lr"]
        param.mul_(1 - lr * group["weight_decay"])
        param.add_(_like(ortho, param), alpha=-lr * math.sqrt(max(1.0, rows / cols)))

    def _adamw(self, param, group) -> None:
        state = self.state[param]
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(param)
            state["exp_avg_sq"] = torch.zeros_like(param)
        state["step"] += 1
        step = float(state["step"])
        beta1, beta2 = group["betas"]
        grad, lr = param.grad, group["lr"]
        param.mul_(1 - lr * group["weight_decay"])
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (state["exp_avg_sq"] / (1 - beta2**step)).sqrt_().add_(group["eps"])
        param.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1**step))


class SignSGD(torch.optim.Optimizer):
    def __init__(self, params, *, lr: float, weight_decay: float):
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if group["weight_decay"]:
                    param.mul_(1 - group["lr"] * group["weight_decay"])
                param.add_(torch.sign(param.grad), alpha=-group["lr"])
        return loss
