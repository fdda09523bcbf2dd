"""One optimisation step's forward and backward passes, split across data-parallel ranks.

Every rank reads the whole step (so all agree on the token count the loss is normalised by)
and takes a share of its packed rows, balanced by tokens. Sharded data parallelism needs
every rank to run the same number of passes, so short shares are padded with rows whose
loss mask is zero.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_VALUE_KEYS = ("loss_mask", "advantages", "inference_logprobs", "teacher_logprobs")
"""A row's per-token values (float32 on the device); its other fields are the token ids and positions."""
_KEYS = ("input_ids", "position_ids", *_VALUE_KEYS)


def share(rows: list[dict], rank: int, size: int) -> list[dict]:
    """This rank's rows: largest first onto the least-loaded rank, then padded so every rank
    has as many rows as the busiest one."""
    if size == 1:
        return list(rows)
    loads = [0] * size
    shares: list[list[dict]] = [[] for _ in range(size)]
    for row in sorted(rows, key=lambda r: -len(r["input_ids"])):
        target = min(range(size), key=lambda i: (loads[i], len(shares[i])))
        shares[target].append(row)
        loads[target] += len(row["input_ids"])
    mine = shares[rank]
    longest = max(len(s) for s in shares)
    return mine + [padding_row() for _ in range(longest - len(mine))]


def padding_row() -> dict:
    return {"input_ids": [0, 0], "position_ids": [0, 1], "loss_mask": [0, 0], "advantages": [0.0, 0.0],
            "inference_logprobs": [0.0, 0.0], "padding": True}


def loss_tokens(row: dict) -> int:
    """The tokens of ``row`` trained on. Its fields are lists or numpy arrays (a step file's rows);
    the count is taken in int64, never in the mask's own uint8."""
    import numpy as np

    return int(np.sum(row["loss_mask"], dtype=np.int64))


def host_tensors(arrays: dict, device) -> dict[str, Any]:
    """numpy ``arrays`` on ``device`` as tensors of their dtypes. The arrays of one dtype go over
    in one copy from one host buffer, on a GPU from pinned memory and asynchronously: a copy
    from pageable memory waits until the GPU has finished everything queued before it, so the
    next micro-batch's would leave the GPU idle while the host works."""
    import numpy as np
    import torch

    groups: dict = {}
    for key, array in arrays.items():
        groups.setdefault(array.dtype, []).append(key)
    device = torch.device(device)
    pinned = device.type == "cuda"
    out = {}
    for dtype, keys in groups.items():
        sizes = [arrays[key].size for key in keys]
        host = torch.empty(sum(sizes), dtype=torch.from_numpy(np.empty(0, dtype)).dtype, pin_memory=pinned)
        np.concatenate([arrays[key].reshape(-1) for key in keys], out=host.numpy())
        moved = host.to(device, non_blocking=True) if pinned else host
        out.update(zip(keys, moved.split(sizes), strict=True))
    return out


def train_step(training, rows: list[dict], *, max_norm: float | None, loss_fn=None, loss_kwargs: dict | None = None,
               temperature: float = 1.0) -> dict:
    """One optimizer step over this rank's share of ``rows`` (the whole step's packed rows):
    returns the sums over all ranks, plus ``grad_norm``, ``loss_tokens`` and this rank's
    ``rows`` (padding included). The ranks of a context-parallel group share their rows and
    each computes its part of every row."""
    return queue_train_step(training, rows, max_norm=max_norm, loss_fn=loss_fn, loss_kwargs=loss_kwargs,
                            temperature=temperature)()


def queue_train_step(training, rows: list[dict], *, max_norm: float | None, loss_fn=None,
                     loss_kwargs: dict | None = None, temperature: float = 1.0) -> Callable[[], dict]:
    """``train_step`` without waiting for the device: the step, down to the update and the
    all-reduce of its sums, is queued, and the returned function waits for it and returns
    ``train_step``'s dict. A loop that queues the next step before reading this one keeps the
    GPU busy while the host starts the next step (uploads its batch, launches its first
    kernels); it must read a step before anything reads the weights it updated."""
    from prime_core.trainer.optim import clip_and_step

    world = training.world
    cp = world.rows_split
    stacked = 1
    if stackable(training.policy.model, cp):
        # From the whole step, not this rank's share: every rank then makes as many passes,
        # which sharded data parallelism needs.
        shorter = repacked(rows)
        longest = max((len(row["input_ids"]) for row in shorter), default=1)
        stacked = rows_per_pass(training.policy.model, longest, training.pass_tokens, cp)
        if stacked > 1:
            rows = shorter
    total = sum(loss_tokens(row) for row in rows)
    mine = share(rows, world.rank // cp, world.size // cp)
    queued = queue_forward_backward(training.policy.model, mine, total_loss_tokens=total, world=world,
                                    loss_fn=loss_fn, loss_kwargs=loss_kwargs, temperature=temperature,
                                    rows_per_pass=stacked, before_backward=training.policy.before_backward)
    # The sums are read only after the update is queued: reading them first would leave the
    # GPU idle while the host runs the hooks and queues the clipping and the optimizer.
    for hook in training.policy.before_step:
        hook(training.policy.model)
    grad_norm = clip_and_step(training.policy.model, training.optimizer, training.scheduler, max_norm,
                              update=training.policy.update)
    read = queue_sums(*queued, grad_norm=grad_norm, world=world)
    return lambda: {**read(), "loss_tokens": total, "rows": mine}


class StepClock:
    """Times steps that may be queued on the device before the one before them is read. A
    step's time runs from when it was queued, or from the end of the step before it on the
    device when that is later: with the next step always queued ahead, the device's time
    between the two steps' ends, idle gaps included. Marks are CUDA events on a GPU (read
    once the step has been read) and host clock readings elsewhere, where the device has
    finished a step by the time it is queued."""

    def __init__(self, device) -> None:
        import torch

        self.cuda = torch.device(device).type == "cuda"
        self.last_end = None

    def mark(self):
        """A mark at this point of the device's queue."""
        import time

        import torch

        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def step_time(self, start, end) -> float:
        """Seconds of the step queued between marks ``start`` and ``end``, once it is read;
        steps are timed in the order they were queued."""
        elapsed = self._seconds(start, end)
        if self.last_end is not None:
            elapsed = min(elapsed, self._seconds(self.last_end, end))
        self.last_end = end
        return elapsed

    def _seconds(self, first, then) -> float:
        if not self.cuda:
            return then - first
        then.synchronize()
        return first.elapsed_time(then) / 1e3


def stackable(model, cp: int) -> bool:
    """Whether ``model`` takes a batch of rows in one pass: attention masked from the position
    ids (no ``Packing``, no fused LM head), whole rows (no context parallelism)."""
    return cp == 1 and getattr(model, "lm_head_fn", None) is None and not getattr(model, "accepts_packing", False)


def rows_per_pass(model, longest: int, pass_tokens: int, cp: int) -> int:
    """How many packed rows go through ``model`` in one forward pass: as many rows of
    ``longest`` tokens as fit in ``pass_tokens`` where the model is ``stackable``; one otherwise."""
    return max(1, pass_tokens // max(1, longest)) if stackable(model, cp) else 1


def repacked(rows: list[dict]) -> list[dict]:
    """The samples of ``rows`` (each begins where ``position_ids`` is 0), first-fit-decreasing
    into rows as long as the longest sample. Every sample keeps its tokens and values, so the
    loss and its gradients are unchanged; what changes is the cost of a mask-based attention,
    which computes every pair of a row's positions: rows of 2,048 tokens holding samples of
    100 spend most of it between samples. Padding rows are dropped (``share`` pads again)."""
    import numpy as np

    pieces = []
    for row in rows:
        if row.get("padding"):
            continue
        positions = np.asarray(row["position_ids"])
        bounds = sorted({0, *np.flatnonzero(positions == 0).tolist(), len(positions)})
        keys = [key for key in _KEYS if row.get(key) is not None]
        spans = zip(bounds[:-1], bounds[1:], strict=True)
        pieces += [{key: np.asarray(row[key])[a:b] for key in keys} for a, b in spans]
    if not pieces:
        return list(rows)
    length = max(len(piece["input_ids"]) for piece in pieces)
    groups: list[list[dict]] = []
    used: list[int] = []
    for piece in sorted(pieces, key=lambda p: -len(p["input_ids"])):
        n = len(piece["input_ids"])
        slot = next((i for i, u in enumerate(used) if u + n <= length), None)
        if slot is None:
            groups.append([piece])
            used.append(n)
        else:
            groups[slot].append(piece)
            used[slot] += n
    out = []
    for group in groups:
        keys = [key for key in _KEYS if any(key in piece for piece in group)]
        # A sample no teacher scored has 0.0 (``MicroBatch``) beside samples that have values.
        out.append({key: np.concatenate([piece[key] if key in piece else np.zeros(len(piece["input_ids"]))
                                         for piece in group]) for key in keys})
    return out


def stacked_tensors(rows: list[dict], device) -> dict:
    """``prediction_tensors`` of several whole rows as ``[B, L]`` tensors, each row padded to
    the longest with a sample of its own (positions from 0, loss mask 0), which the
    block-diagonal mask keeps apart from the row's samples."""
    import torch

    parts = [prediction_tensors(row, device)[0] for row in rows]
    length = max(len(p["input_ids"]) for p in parts)
    keys = list(dict.fromkeys(key for p in parts for key in p))  # a padding row has no teacher's values
    for row, part in zip(rows, parts, strict=True):
        if not row.get("padding") and set(part) != set(keys):
            raise ValueError(f"rows of one step differ in their fields: {sorted(set(keys) - set(part))} missing")

    def padded(key: str, part: dict):
        value = part.get(key)
        if value is None:
            value = part["loss_mask"].new_zeros(len(part["input_ids"]))
        pad = length - len(value)
        if not pad:
            return value
        fill = torch.arange(pad, device=value.device) if key == "position_ids" else value.new_zeros(pad)
        return torch.cat([value, fill])

    return {key: torch.stack([padded(key, p) for p in parts]) for key in keys}


def prediction_tensors(row: dict, device, cp_rank: int = 0, cp: int = 1):
    """The row as the model sees it, aligned with predictions: at input position j the
    target is token j + 1, and the loss mask, advantage and inference log-probability are
    that target's. With context parallelism the row is padded to a multiple of ``2 * cp``
    (padding is its own sample, with a zero loss mask) and this CP rank keeps its tokens
    (``packing.cp_indices``). Returns ``(tensors, packing)``: token ids and positions int64,
    the rest float32, and the row's ``Packing`` (this rank's part of it under CP).

    Everything is derived on the host, from the row's arrays, and goes to the device in one
    copy per dtype: the sample boundaries the attention kernels need are then known without
    reading the device (``Packing.starts``), and no small kernels run ahead of the model."""
    import numpy as np
    import torch

    from prime_core.trainer import packing as packing_

    ids = np.asarray(row["input_ids"], dtype=np.int64)
    positions = np.asarray(row["position_ids"], dtype=np.int64)
    host = {"input_ids": ids, "position_ids": positions, "targets": np.roll(ids, -1)}
    for key in _VALUE_KEYS:  # per-target values move to the position that predicts them
        if row.get(key) is not None:
            value = np.asarray(row[key], dtype=np.float32)
            host[key] = np.concatenate([value[1:], np.zeros(1, np.float32)])
    pad = packing_.pad_to(len(ids), 2 * cp) - len(ids) if cp > 1 else 0
    if pad:
        host = {key: np.concatenate([value, np.arange(pad, dtype=np.int64) if key == "position_ids"
                                     else np.zeros(pad, value.dtype)]) for key, value in host.items()}
    host["segment_ids"] = packing_.segment_ids(host["position_ids"])
    t = host_tensors(host, device)
    length = len(host["input_ids"])
    whole = packing_.Packing(segment_ids=t.pop("segment_ids"), index=torch.arange(length, device=t["input_ids"].device),
                             length=length, starts=packing_.sample_starts(host["position_ids"]))
    if cp == 1:
        return t, whole
    local = packing_.cp_indices(length, cp_rank, cp, device=t["input_ids"].device)
    return {key: value[local] for key, value in t.items()}, whole.select(local)


def forward_backward(model, rows: list[dict], *, total_loss_tokens: int, world, loss_fn=None,
                     loss_kwargs: dict | None = None, temperature: float = 1.0, rows_per_pass: int = 1,
                     before_backward=()) -> dict:
    """Forward and backward over this rank's rows, ``rows_per_pass`` at a time; the loss is
    normalised by the loss tokens of the whole step on every rank. With ``loss_fn`` the RL
    loss is used, otherwise the negative log-likelihood (SFT). ``before_backward``: the
    policy's ``hook(model, last)`` calls (``Applied.before_backward``). Returns this rank's
    sums (reduce them across ranks)."""
    return queue_sums(*queue_forward_backward(model, rows, total_loss_tokens=total_loss_tokens, world=world,
                                              loss_fn=loss_fn, loss_kwargs=loss_kwargs, temperature=temperature,
                                              rows_per_pass=rows_per_pass, before_backward=before_backward))()


def queue_forward_backward(model, rows: list[dict], *, total_loss_tokens: int, world, loss_fn=None,
                           loss_kwargs: dict | None = None, temperature: float = 1.0,
                           rows_per_pass: int = 1, before_backward=()) -> tuple[dict, float]:
    """``forward_backward`` without waiting for the device: its sums as device tensors, and
    the tokens computed; ``queue_sums`` reads them."""
    from prime_core.trainer.model import predicted_logprobs

    cp = world.rows_split
    cp_rank = world.rank % cp
    norm = max(1, total_loss_tokens)
    scale = world.size / norm  # data-parallel gradient reduction averages over ranks; the loss sums
    # Summed on the device and read once at the end: a read per row would make the GPU wait
    # for the host to queue each next row.
    device_sums: dict = {}
    tokens = 0.0
    for start in range(0, len(rows), rows_per_pass):
        group = rows[start:start + rows_per_pass]
        if rows_per_pass > 1:  # [B, L]; the per-token values flattened like the predictions
            t, packing = stacked_tensors(group, world.device), None
            t = {key: value if key in ("input_ids", "position_ids") else value.flatten() for key, value in t.items()}
        else:
            t, packing = prediction_tensors(group[0], world.device, cp_rank, cp)
            t = {**t, "input_ids": t["input_ids"][None], "position_ids": t["position_ids"][None]}
        logp, entropy = predicted_logprobs(model, t["input_ids"], t["position_ids"], t["targets"],
                                           packing=packing, temperature=temperature, with_entropy=loss_fn is not None)
        mask = t["loss_mask"]
        if loss_fn is None:
            per_token, extra = -logp, {}
        else:
            kwargs = dict(loss_kwargs or {})
            if "teacher_logprobs" in t:  # on-policy distillation: the teacher's log-probability of each target
                kwargs["teacher_logprobs"] = t["teacher_logprobs"]
            per_token, extra = call_loss(loss_fn, logp, t["inference_logprobs"], t["advantages"], kwargs)
        loss = (per_token * mask).sum() * scale
        for hook in before_backward:
            hook(model, start + rows_per_pass >= len(rows))
        loss.backward()
        parts = {"loss": loss.detach().float() / world.size}
        tokens += sum(len(row["input_ids"]) for row in group if not row.get("padding")) / cp
        if entropy is not None:
            parts["entropy"] = (entropy.detach() * mask).sum().float() / norm
        for key in ("mismatch_kl", "is_masked", "teacher_kl"):
            if key in extra:
                parts[key] = (extra[key].detach() * mask).sum().float() / norm
        for key, value in parts.items():
            device_sums[key] = device_sums[key] + value if key in device_sums else value
    return device_sums, tokens


SUM_KEYS = ("entropy", "is_masked", "loss", "mismatch_kl", "teacher_kl", "tokens")
"""The sums every rank reports (all-reduced together), whatever its rows held."""


def queue_sums(device_sums: dict, tokens: float, grad_norm=None, world=None) -> Callable[[], dict]:
    """The sums of ``queue_forward_backward`` (summed over ``world``'s ranks when given) and the
    step's ``grad_norm`` (global already), queued on the device: the returned function reads
    them in one transfer, so the host waits once, at the end of the step. Every value is made
    on the device (a copy from the host would wait for the queued step)."""
    import torch

    if device_sums:
        device = next(iter(device_sums.values())).device
    else:
        device = torch.device(world.device if world is not None else "cpu")
    # in float64: a step's token count can pass float32's exact integers
    parts = {**device_sums, "tokens": torch.full((), float(tokens), dtype=torch.float64, device=device)}
    summed = torch.stack([parts[key].double() if key in parts else torch.zeros((), dtype=torch.float64, device=device)
                          for key in SUM_KEYS])
    if world is not None and world.distributed:
        from prime_core import distributed

        summed = summed.to(world.device)
        distributed.all_reduce_tensor(summed, world)
    host_norm = None
    if torch.is_tensor(grad_norm):
        # the norm of CPU-offloaded gradients is on the host
        summed = torch.cat([summed, grad_norm.detach().reshape(1).to(summed)])
    elif grad_norm is not None:
        host_norm = float(grad_norm)
    ready = None
    if summed.device.type == "cuda":
        # Copied now, not when read: by then the next step may be queued, and a copy queued
        # after it would wait for it.
        host = torch.empty(summed.shape, dtype=summed.dtype, pin_memory=True)
        host.copy_(summed, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        summed = host

    def read() -> dict:
        if ready is not None:
            ready.synchronize()
        values = summed.tolist()
        sums = dict(zip(SUM_KEYS, values, strict=False))
        if grad_norm is not None:
            sums["grad_norm"] = values[-1] if host_norm is None else host_norm
        return sums

    return read


def call_loss(loss_fn, logp, inference_logprobs, advantages, kwargs: dict):
    """``loss_fn`` on one row; a loss that does not take the teacher's log-probabilities is named."""
    try:
        return loss_fn(logp, inference_logprobs, advantages, **kwargs)
    except TypeError as exc:
        if "teacher_logprobs" in kwargs and "teacher_logprobs" in str(exc):
            from prime_core.errors import PrimeError

            raise PrimeError(f"trainer.loss: {getattr(loss_fn, '__name__', loss_fn)} does not take teacher_logprobs, "
                             "which this batch carries (orchestrator.teacher scores the samples)",
                             hint="use the default loss (trainer.loss.type = 'default'), or give the loss a "
                                  "teacher_logprobs=None keyword") from None
        raise
