"""Versions of the ``nccl`` weight transport received into this backend's engine.

The transport (prime-plugin-vllm's ``broadcast.py``; it does not import vLLM) has trainer rank 0
send each version over one process group: NCCL on GPUs, gloo on CPUs. A server joins the group
the first time it is asked to load a version announced with ``BROADCAST.json`` (again when the
trainer restarted: a new group id), then takes the version's buckets as they arrive, while the
model goes on serving; only the copy into the model pauses generation, as for files. The
buckets are held on the model's device until then: one extra copy of the weights, freed after
the copy. Every receiver must take every version (the trainer waits for all of them), which the
orchestrator does for this transport (``loads_every_version``).
"""

from __future__ import annotations

from pathlib import Path

from prime_plugin_transformers.weights import Staged, WeightsError, _plan, _targets

INSTALL = "pip install prime-plugin-vllm (the nccl transport's receiving side; vLLM itself is not needed)"


def is_broadcast(folder) -> bool:
    """Whether a published version folder announces a broadcast (prime-plugin-vllm's descriptor)."""
    return (Path(folder) / "BROADCAST.json").is_file()


def answer_within(folder) -> float:
    """Seconds a client waits for a server receiving ``folder``'s version: joining the group and
    the transfer are each bounded by the descriptor's timeout on the server's side."""
    import json

    return 2 * float(json.loads((Path(folder) / "BROADCAST.json").read_text())["timeout"]) + 60


def _protocol():
    try:
        from prime_plugin_vllm import broadcast
    except ImportError as exc:
        raise WeightsError(f"the trainer broadcasts its weights (weight_broadcast.type = 'nccl') and this server "
                           f"cannot receive them ({exc}): {INSTALL}") from None
    return broadcast


class Receiving:
    """One server's membership of the trainer's group, kept from one version to the next."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.receiver = None

    def staged(self, model, folder: Path) -> Staged:
        broadcast = _protocol()
        descriptor = broadcast.read_descriptor(folder)
        step = int(descriptor["step"])
        if self.receiver is None or self.receiver.group_id != descriptor["group"]:
            if self.receiver is not None:
                self.receiver.close()  # the trainer restarted: its old group is gone
            self.receiver = broadcast.Receiver(descriptor, device=next(model.parameters()).device, label=self.label)
        tensors = dict(self.receiver.receive(step))  # every bucket, even for a model that turns out not to fit
        state, alias = _targets(model)
        plan = _plan(state, alias, {k: tuple(v.shape) for k, v in tensors.items()}, folder)
        return Staged({plan[k]: v for k, v in tensors.items()}, f"received over {descriptor['backend']}, copied in "
                      "place", step=step)

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
