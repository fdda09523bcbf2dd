"""Optimizer and learning-rate schedule from ``optim`` / ``scheduler`` config."""

from __future__ import annotations

import math


def build_optimizer(model, optim_config, *, cpu_offload: bool = False):
    """The optimizer over the trainable parameters; with ``cpu_offload`` its state lives in
    CPU memory between steps (``trainer.model.optim_cpu_offload``)."""
    import torch

    from prime_core.trainer.muon import Muon, SignSGD

    params = [p for p in model.parameters() if p.requires_grad]
    if optim_config.type == "sgd":
        optimizer = torch.optim.SGD(params, lr=optim_config.lr, weight_decay=optim_config.weight_decay,
                                    momentum=optim_config.momentum,
                                    nesterov=optim_config.nesterov and optim_config.momentum > 0)
    elif optim_config.type == "muon":
        optimizer = Muon(model.named_parameters(), lr=optim_config.lr, weight_decay=optim_config.weight_decay,
                         momentum=optim_config.mu, nesterov=optim_config.nesterov, betas=tuple(optim_config.betas))
    elif optim_config.type == "sign_sgd":
        optimizer = SignSGD(params, lr=optim_config.lr, weight_decay=optim_config.weight_decay)
    else:
        optimizer = torch.optim.AdamW(params, lr=optim_config.lr, weight_decay=optim_config.weight_decay,
                                      betas=tuple(optim_config.betas),
                                      fused=bool(params) and params[0].device.type == "cuda")
    if cpu_offload:
        StateOffload(optimizer)
    return optimizer


class StateOffload:
    """Keeps an optimizer's state in CPU memory except during ``step``
    (``trainer.model.optim_cpu_offload``).

    RL steps spend most of their time in many forward/backward passes; the state (two fp32
    copies of the parameters for AdamW) is only needed for the update, so it stays off the
    accelerator while activations are alive. On GPUs each state tensor has a persistent pinned
    host buffer and both copies are asynchronous on the compute stream (stream order keeps them
    safe). While offloaded, a sharded (DTensor) state is held as its local shard: wrapping a
    CPU shard in a DTensor would move it straight back to the mesh's device.
    Checkpointing calls ``to_device`` / ``to_host`` around reading or writing the state.
    """

    def __init__(self, optimizer) -> None:
        import torch

        self.optimizer = optimizer
        self.pin = torch.cuda.is_available()
        self.host: dict = {}
        self.layout: dict = {}
        optimizer.register_step_pre_hook(lambda *_: self.to_device())
        optimizer.register_step_post_hook(lambda *_: self.to_host())
        optimizer.register_load_state_dict_post_hook(lambda *_: self.to_host())
        optimizer.prime_state_offload = self

    def _states(self):
        import torch

        for param, state in self.optimizer.state.items():
            for key, value in state.items():
                if torch.is_tensor(value) and key != "step":  # fused AdamW keeps `step` with the params
                    yield param, state, key, value

    def to_host(self) -> None:
        import torch

        for param, state, key, value in list(self._states()):
            source = value.to_local() if hasattr(value, "to_local") else value
            if source.device.type == "cpu":
                continue
            slot = (id(param), key)
            if hasattr(value, "to_local"):
                self.layout[slot] = (value.device_mesh, value.placements, value.shape, value.stride())
            buffer = self.host.get(slot)
            if buffer is None or buffer.shape != source.shape:
                buffer = self.host[slot] = torch.empty(source.shape, dtype=source.dtype, pin_memory=self.pin)
            buffer.copy_(source, non_blocking=self.pin)
            state[key] = buffer

    def to_device(self) -> None:
        for param, state, key, value in list(self._states()):
            device = (param.to_local() if hasattr(param, "to_local") else param).device
            if hasattr(value, "to_local") or value.device == device:
                continue
            moved = value.to(device, non_blocking=self.pin)
            layout = self.layout.get((id(param), key))
            if layout is not None:
                from torch.distributed.tensor import DTensor

                mesh, placements, shape, stride = layout
                moved = DTensor.from_local(moved, mesh, placements, run_check=False, shape=shape, stride=stride)
            state[key] = moved


def lr_factor(scheduler_config, lr: float, max_steps: int | None, step: int) -> float:
    """The learning rate of ``step`` (0-based) as a fraction of ``lr``, as prime-rl schedules it:
    warmup rises linearly from ``min_lr`` to ``lr``; ``linear`` then holds ``lr`` and falls
    linearly to ``min_lr`` over the last ``decay_steps`` steps; ``cosine`` falls from ``lr`` to
    ``min_lr`` along a half cosine by ``max_steps``."""
    warmup = scheduler_config.warmup
    low = scheduler_config.min_lr / lr if scheduler_config.min_lr > 0 else 1e-8
    if step < warmup:
        return low + (1.0 - low) * step / warmup
    if scheduler_config.type == "constant" or not max_steps:
        return 1.0
    if scheduler_config.type == "linear":
        decay = scheduler_config.decay_steps
        start = max_steps - decay
        if decay <= 0 or step < start:
            return 1.0
        return 1.0 + (low - 1.0) * min(1.0, (step - start) / max(1, decay - 1))
    low = scheduler_config.min_lr / lr
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return low + (1.0 - low) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer, scheduler_config, max_steps: int | None):
    import torch

    lr = optimizer.param_groups[0]["lr"] if optimizer.param_groups else 1.0
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(scheduler_config, lr, max_steps, step))


def clip_and_step(model, optimizer, scheduler, max_norm: float | None, update=None):
    """Clip the gradients to ``max_norm`` and step; returns the norm before clipping, as the
    device holds it (a 0-dim tensor, or 0.0 without gradients): the caller reads it with
    whatever else it reads after the step, in one transfer. A strategy's ``update`` hook
    (``Applied.update``) may do both itself."""
    norm = update(model, optimizer, max_norm) if update is not None else None
    if norm is None:
        norm = clip_grad_norm([p for p in model.parameters() if p.grad is not None], max_norm)
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def clip_grad_norm(params: list, max_norm: float | None):
    """Scale the gradients so that their global 2-norm is at most ``max_norm``; returns the
    norm before clipping (a scalar tensor, or 0.0 without gradients).

    Parameters may be sharded over different meshes (FSDP's, and EP's experts). The work runs
    on the local shards (one fused norm and one fused scale over all of them, none of DTensor's
    per-call dispatch); each group's sum of squares is then summed over the mesh dimensions
    its gradients are sharded on, so replicated copies count once."""
    import torch
    from torch.distributed.tensor import DTensor

    if not params:
        return 0.0
    groups: dict[tuple, tuple] = {}  # (mesh id, sharded dims) -> (mesh, local gradients)
    for param in params:
        grad, mesh, dims = param.grad, None, ()
        if isinstance(grad, DTensor):
            mesh, dims = grad.device_mesh, tuple(i for i, p in enumerate(grad.placements) if p.is_shard())
            grad = grad.to_local()
        groups.setdefault((id(mesh), dims), (mesh, []))[1].append(grad)
    local = [grad for _, grads in groups.values() for grad in grads]
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in local) else torch.float32
    squares = []
    for (_, dims), (mesh, grads) in groups.items():
        square = squared_norm(grads).to(dtype)
        for dim in dims:
            torch.distributed.all_reduce(square, group=mesh.get_group(dim))
        squares.append(square)
    total = torch.stack(squares).sum().sqrt()
    if max_norm:
        scale = clip_factor(total, max_norm)
        by_dtype: dict = {}
        for grad in local:
            by_dtype.setdefault(grad.dtype, []).append(grad)
        for grad_dtype, grads in by_dtype.items():
            # The factor in the gradients' own dtype: a 0-dim factor of another dtype sends
            # _foreach_mul_ down its per-tensor path on CUDA (12 ms a step for the 2.9B MoE's
            # bf16 gradients on an H200, 4 ms in one fused pass). bf16 keeps 3 digits of it.
            torch._foreach_mul_(grads, scale.to(grad_dtype))
    return total


def squared_norm(grads: list):
    """The sum of the squares of ``grads`` (local tensors), in float32 at least: each 16-bit
    gradient's norm is taken in float32 (in its own dtype it would keep 3 digits)."""
    import torch

    wide = [g for g in grads if g.dtype.itemsize >= 4]
    narrow = [g for g in grads if g.dtype.itemsize < 4]
    norms = list(torch._foreach_norm(wide)) if wide else []
    if narrow:
        norms += torch._foreach_norm(narrow, 2, dtype=torch.float32)
    dtype = torch.float64 if any(n.dtype == torch.float64 for n in norms) else torch.float32
    return torch.stack([n.to(dtype) for n in norms]).pow(2).sum()


def clip_factor(total, max_norm: float):
    """What the gradients are multiplied by so that their norm ``total`` is at most ``max_norm``."""
    return (max_norm / (total + 1e-6)).clamp(max=1.0)
