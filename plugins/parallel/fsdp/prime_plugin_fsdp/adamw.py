"""AdamW over ``one_process``'s master weights in one pass: clipping, the update and the
refreshed compute copies.

Unfused, the update reads and writes every parameter five times: the bf16 gradients cast to
float32 (6 bytes a parameter), the norm (4), the clip (8), ``torch.optim.AdamW`` (28) and the
next step's compute copy from the master (6): 52 bytes a parameter. Here the norm reads the
gradients as they are held (2 bytes for one micro-batch's bf16), and one kernel reads the
gradient, master and both moments and writes the master, the moments and the compute copy:
30 bytes a parameter, and no float32 gradient is ever allocated for a single micro-batch.

The arithmetic is ``torch.optim.AdamW``'s (``_single_tensor_adam``): the clipped gradient
``g * clip``, ``p * (1 - lr * wd)``, ``m`` moved towards ``g`` by ``1 - beta1``,
``v * beta2 + (1 - beta2) * g * g``, then ``p - lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)``
with the bias corrections ``bc = 1 - beta ** step`` computed on the host in double precision,
division and square root correctly rounded. Each compute copy is its master rounded to
bfloat16 (nearest, ties to even), as the unfused refresh casts it. The optimizer's state is
AdamW's own (``step``, ``exp_avg``, ``exp_avg_sq``, created as AdamW creates them), so a
checkpoint written by either path resumes in the other.

Weights held in bfloat16 with no master (``one_process.PlainWeights``: compute and
optimization dtype both bfloat16) are stepped in place the same way, their moments in bfloat16
as ``torch.optim.AdamW`` keeps them: float32 arithmetic, each result rounded to bfloat16 (as the
fused ``torch.optim.AdamW`` does), no copy written: 16 bytes a parameter with the norm's read,
where the trainer's norm, clip and ``torch.optim.AdamW(fused=True)`` move 20. As every result is
rounded to bfloat16, division and square root are the GPU's fast ones (within 2 float32 units):
a result can round the other way only where its last float32 bits decide, and the kernel, partly
compute-bound, took 12.0 ms instead of 12.7 for the 2.9B MoE shape on an H200.

Used by ``MasterWeights.update`` and ``PlainWeights.update`` when ``why_not`` finds nothing
against it; otherwise the gradients go to ``param.grad`` and the trainer clips and steps as usual.
"""

from __future__ import annotations

import os

BLOCK, WARPS = 1024, 8
"""Elements per program, and its warps: four elements (one 16-byte read of float32) a thread.
On an H200 the MoE 2.9B shape's update took 22.4 ms at this shape, 25.3 ms at 4,096 and 4 warps
(32 a thread), 29-40 ms at 8 a thread (``kernels_bench.py adamw --launch``; the table is in the
plugin's README)."""


BLOCK_16 = 2048
"""Elements per program for bfloat16 weights: again 16 bytes of the weight a thread."""


NORM_BLOCK, NORM_WARPS = 8192, 8
"""The gradient norm's elements per program (``adamw_kernel.squares``), and its warps."""


def why_not(weights, optimizer) -> str | None:
    """Why this optimizer's step cannot be fused over ``weights`` (``None``: it can)."""
    import torch

    if type(optimizer) is not torch.optim.AdamW:
        return f"the optimizer is {type(optimizer).__name__} (trainer.optim.type), not AdamW"
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    if (optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
            or _global_optimizer_pre_hooks or _global_optimizer_post_hooks):
        return "the optimizer has step hooks (trainer.model.optim_cpu_offload registers them)"
    for group in optimizer.param_groups:
        if group.get("amsgrad") or group.get("maximize") or group.get("differentiable"):
            return "amsgrad, maximize or differentiable is set"
        if any(torch.is_tensor(group[key]) for key in ("lr", "betas", "eps", "weight_decay")):
            return "a hyperparameter is a tensor"
    masters = {id(p) for p in weights.masters}
    if any(id(p) not in masters for group in optimizer.param_groups for p in group["params"]):
        return "the optimizer steps parameters that are not master weights"
    if not weights.masters:
        return "no trainable parameter"
    unfit = _unfit_weights(weights)
    if unfit:
        return unfit
    device = weights.masters[0].device
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "the weights are not on a GPU"
    if any(p.device != device for p in weights.masters):
        return "the master weights are on several devices"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return None


def _unfit_weights(weights) -> str | None:
    """Why the kernel cannot read and write ``weights`` (``None``: it can): float32 masters with
    bfloat16 compute copies, or weights of one dtype without copies; all contiguous and aligned."""
    import torch

    if not weights.copies:
        if any(p.dtype != weights.masters[0].dtype or p.dtype not in (torch.float32, torch.bfloat16)
               or not readable(p) for p in weights.masters):
            return "the weights are not contiguous, aligned tensors of one dtype, float32 or bfloat16"
        return None
    if any(p.dtype != torch.float32 or not readable(p) for p in weights.masters):
        return "the master weights are not contiguous, aligned float32 tensors (trainer.model.optimization_dtype)"
    if not all(readable(c) for c in weights.copies):
        return "the compute copies are not contiguous and aligned"
    if any(c.dtype != torch.bfloat16 for c in weights.copies):
        return "the compute dtype is not bfloat16 (trainer.model.dtype)"
    return None


def step(weights, optimizer, max_norm: float | None, gradients: list):
    """Clip ``gradients`` (one per master, or ``None``) to ``max_norm`` and step ``optimizer``
    over the masters, writing each stepped master's compute copy. Returns the norm before
    clipping (a 0-dim float32 tensor)."""
    import torch

    from prime_core.trainer.optim import clip_factor

    device = weights.masters[0].device
    if all(g is None for g in gradients):
        return torch.zeros((), device=device)
    for index, grad in enumerate(gradients):
        if grad is not None and not readable(grad):
            gradients[index] = grad.clone(memory_format=torch.contiguous_format)
    norm = squared_norm(weights, gradients).sqrt()
    clip = clip_factor(norm, max_norm) if max_norm else torch.ones((), device=device)
    launches: dict[tuple, list[int]] = {}
    steps = []
    for group in optimizer.param_groups:
        beta1, beta2 = group["betas"]
        lr, decay, eps = group["lr"], group["weight_decay"], group["eps"]
        for param in group["params"]:
            index = weights.index_of[id(param)]
            grad = gradients[index]
            if grad is None:
                continue
            state = optimizer.state[param]
            if not state:
                _init_state(state, param, group)
            count = weights.step_counts.count(state["step"]) + 1
            steps.append(state["step"])
            bc1, bc2 = 1 - beta1 ** count, 1 - beta2 ** count
            key = (grad.dtype, 1 - lr * decay, 1 - beta1, beta2, 1 - beta2, lr / bc1, bc2 ** 0.5, eps)
            launches.setdefault(key, []).append(index)
    from prime_plugin_fsdp.adamw_kernel import adamw

    block = BLOCK if weights.masters[0].dtype == torch.float32 else BLOCK_16
    items, first = weights.step_grid(block)
    for key, indices in launches.items():
        table = _table(weights, optimizer, gradients, set(indices))
        grad_dtype, *scalars = key
        adamw[(items.numel(),)](table, items, first, clip, *scalars, GRAD=_triton_type(grad_dtype),
                                PARAM=_triton_type(weights.masters[0].dtype), COPY=bool(weights.copies), BLOCK=block,
                                ROUNDED=not weights.copies and weights.masters[0].dtype == torch.bfloat16,
                                num_warps=WARPS)
    torch._foreach_add_(steps, 1.0)
    weights.step_counts.advanced(steps)
    optimizer._opt_called = True  # what optimizer.step() marks: the LR scheduler warns without it
    return norm


def squared_norm(weights, gradients: list):
    """The sum of the squares of ``gradients`` (readable, one per master or ``None``) in float32:
    each ``NORM_BLOCK`` of a gradient summed by one program of ``adamw_kernel.squares``, then the
    programs' sums; those the step's last backward pass took are not read again
    (``norms.GradientNorms``). ``torch._foreach_norm`` read the MoE 2.9B shape's bf16 gradients
    at about 2.4 TB/s (2.4 ms a step on an H200)."""
    return weights.norms.squared(gradients)


def _triton_type(dtype):
    """A weight's or gradient's dtype as the kernels name it (float32 or bfloat16: ``why_not``
    and the compute dtype leave no other)."""
    import torch
    import triton.language as tl

    return tl.float32 if dtype == torch.float32 else tl.bfloat16


def _init_state(state: dict, param, group: dict) -> None:
    """AdamW's state for ``param``, as ``torch.optim.AdamW`` creates it."""
    import torch

    if group["fused"] or group["capturable"]:
        state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
    else:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _table(weights, optimizer, gradients: list, stepped: set[int]):
    """Every master's row of addresses and size (``adamw_kernel``); rows outside ``stepped``
    have no gradient address, so this launch leaves them alone."""
    import torch

    rows = []
    for index, master in enumerate(weights.masters):
        if index not in stepped:
            rows.append((0, 0, 0, 0, 0, 0))
            continue
        state = optimizer.state[master]
        moments = state["exp_avg"], state["exp_avg_sq"]
        if not all(readable(m) and m.dtype == master.dtype for m in moments):  # the kernel reads them as the master
            state["exp_avg"], state["exp_avg_sq"] = moments = tuple(
                m.to(master.dtype, memory_format=torch.contiguous_format, copy=True) for m in moments)
        copy = weights.copies[index].data_ptr() if weights.copies else 0
        rows.append((master.data_ptr(), gradients[index].data_ptr(), moments[0].data_ptr(), moments[1].data_ptr(),
                     copy, master.numel()))
    return _addresses(rows, weights.masters[0].device)


def _addresses(rows: list[tuple], device):
    """A kernel's address table on ``device``."""
    import torch

    table = torch.tensor(rows, dtype=torch.int64)
    if device.type == "cuda":  # pinned and asynchronous: a pageable copy would wait for the backward pass
        return table.pin_memory().to(device, non_blocking=True)
    return table


def readable(tensor) -> bool:
    """Whether the kernel may read ``tensor`` as it is: contiguous, 16-byte aligned."""
    return tensor.is_contiguous() and tensor.data_ptr() % 16 == 0


class StepCounts:
    """The host's count of each ``state["step"]`` tensor, so that the bias corrections need no
    read from the device; a tensor not seen before (a new state, a loaded checkpoint) is read
    once."""

    def __init__(self) -> None:
        self.known: dict[int, tuple] = {}

    def count(self, tensor) -> int:
        held = self.known.get(id(tensor))
        if held is None or held[0] is not tensor:
            held = self.known[id(tensor)] = (tensor, int(tensor.item()))
        return held[1]

    def advanced(self, tensors) -> None:
        for tensor in tensors:
            self.known[id(tensor)] = (tensor, self.known[id(tensor)][1] + 1)


def grid(numels: list[int], block: int, device):
    """``(items, first)`` of ``adamw_kernel.adamw``: each program's tensor, and each tensor's
    first program."""
    import torch

    blocks = torch.tensor([-(-n // block) for n in numels], dtype=torch.int64)
    first = torch.cumsum(blocks, 0) - blocks
    items = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), blocks)
    return items.to(device), first.to(device)


