"""The ``ipc`` weight transport: trainer and inference on one machine share the weights' memory.

On one shared GPU the time from publish to served adds to every asynchronous step: the next
batch is sampled by the version just published. Through the filesystem that is a safetensors
write, a read into host memory and a copy back to the GPU (3.4 GB for a 1.7B model: about 4 s).
Here trainer rank 0 keeps each new version in one of two slots, flat buffers on its own device
(a CUDA allocation the servers open through CUDA IPC; on a CPU, a file in the run folder that
they map), and a server copies the tensors straight into its live model (on a GPU, device to
device: milliseconds for gigabytes). Nothing is serialized, and no version touches the disk.

Version N:

1. **Trainer** (``SharedPublisher.publish``, with the full tensors on its device). It takes
   slot ``N % 2``'s lock exclusively (a server still copying the version before holds it
   shared), copies N's tensors in, synchronizes the device, and writes the slot's header
   (``weights/shared/slot_K.json``: the step, the buffer's handle, each tensor's dtype, shape
   and offset). Then ``weights/step_N/SHARED.json`` names the slot, and the ``STABLE`` marker
   follows as for the filesystem transport, whose loader the orchestrator uses.
2. **Server** (``staged``, from the engine's ``load_weights``). It maps the slot's buffer once
   (again only if the trainer restarted), takes the slot's lock shared, reads the header, and
   copies the tensors in while generation pauses. The slot may by then hold a newer version
   (the trainer moved two steps on before this server read it): that one is loaded, and its
   step reported.

Scope, checked on both sides with the way out: one machine, and a GPU both sides see (found by
its UUID, so each role's ``CUDA_VISIBLE_DEVICES`` may number it differently), or CPUs. Cost:
two copies of the weights in the published dtype on the trainer's device (1.7B in bf16: 6.8 GB).
LoRA adapters are not published this way (this backend serves full weights only).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path

from prime_core.errors import PrimeError
from prime_core.weights import Adapter, announce, weights_dir

DESCRIPTOR = "SHARED.json"
SLOTS = 2
ALIGN = 256
"""Each tensor starts at a multiple of this many bytes, so every dtype's view is aligned."""
LOCK_TIMEOUT = 600.0
FALLBACK = "use weight_broadcast.type = 'filesystem'"


def is_shared(folder) -> bool:
    """Whether a published version folder names a shared slot (rather than holding files)."""
    return (Path(folder) / DESCRIPTOR).is_file()


def layout(state: dict) -> tuple[dict[str, dict], int]:
    """Each tensor's place in a slot (tensors that are one, such as tied weights handed out as
    the same parameter, share it) and the slot's size in bytes."""
    entries: dict[str, dict] = {}
    first: dict[tuple, str] = {}
    size = 0
    for name, tensor in state.items():
        same = first.setdefault((tensor.data_ptr(), tensor.dtype, tuple(tensor.shape)), name)
        if same != name and tensor.numel():
            entries[name] = dict(entries[same])
            continue
        nbytes = tensor.numel() * tensor.element_size()
        entries[name] = {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
                         "offset": size, "bytes": nbytes}
        size += -(-nbytes // ALIGN) * ALIGN
    return entries, max(size, ALIGN)


def view(buffer, entry: dict):
    """The tensor ``entry`` describes, as a view of a slot's flat uint8 ``buffer``."""
    import torch

    start = entry["offset"]
    return buffer[start:start + entry["bytes"]].view(getattr(torch, entry["dtype"])).view(entry["shape"])


@contextmanager
def locked(path: Path, *, exclusive: bool, who: str, timeout: float = LOCK_TIMEOUT):
    """``path``'s advisory lock, waited for at most ``timeout`` seconds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise PrimeError(f"{who}: {path} stayed locked for {timeout:.0f} s (the other side holds it: "
                                     "a server copying weights, or the trainer writing them, is stuck)") from None
                time.sleep(0.002)
        yield
    finally:
        os.close(fd)  # releases the lock


def gpu_uuid(index: int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


# -- trainer side -----------------------------------------------------------------------------


class Slot:
    """One flat buffer on the trainer's device, and how another process opens it."""

    def __init__(self, root: Path, index: int, size: int, device) -> None:
        import torch

        owner = f"{os.getpid()}-{time.time_ns()}"
        self.header = root / f"slot_{index}.json"
        self.lock = root / f"slot_{index}.lock"
        if device.type == "cuda":
            self.buffer = torch.empty(size, dtype=torch.uint8, device=device)
            (dev, handle, nbytes, offset, counter, counter_offset, event, event_sync) = \
                self.buffer.untyped_storage()._share_cuda_()
            self.opens = {"kind": "cuda_ipc", "uuid": gpu_uuid(dev), "handle": handle.hex(), "bytes": nbytes,
                          "offset": offset, "counter": counter.hex(), "counter_offset": counter_offset,
                          "event": event.hex() if event else "", "event_sync": bool(event_sync)}
        elif device.type == "cpu":
            # A new file for each trainer start: a server may still map the last one (truncating
            # a mapped file would crash its reads); unlinking leaves that mapping intact.
            for old in root.glob(f"slot_{index}-*.bin"):
                old.unlink(missing_ok=True)
            path = root / f"slot_{index}-{owner}.bin"
            with open(path, "wb") as f:
                f.truncate(size)
            self.buffer = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
            self.opens = {"kind": "file", "path": str(path.resolve())}
        else:
            raise PrimeError(f"weight_broadcast.type = 'ipc' shares CUDA or CPU memory; the trainer's weights are on "
                             f"{device}", hint=FALLBACK)
        self.opens.update(size=size, host=socket.gethostname(), owner=owner)


class SharedPublisher:
    """Trainer rank 0's side; ``publish`` gets the full tensors on the trainer's device."""

    def __init__(self, config=None, *, output_dir: Path, keep: int = 3) -> None:
        self.root = weights_dir(output_dir)
        self.shared = self.root / "shared"
        self.keep = keep
        self.slots: list[Slot] = []
        self.entries: dict[str, dict] | None = None

    def publish(self, model, step: int, state_dict: dict | None = None) -> Path:
        import torch

        if isinstance(state_dict, Adapter):
            raise PrimeError("weight_broadcast.type = 'ipc' publishes full weights; a LoRA run's adapters go "
                             "through the filesystem", hint="use weight_broadcast.type = 'filesystem' with LoRA")
        state = {k: v.detach() for k, v in (model.state_dict() if state_dict is None else state_dict).items()}
        entries, size = layout(state)
        if self.entries is None:
            self.shared.mkdir(parents=True, exist_ok=True)
            device = next(iter(state.values())).device
            self.slots = [Slot(self.shared, k, size, device) for k in range(SLOTS)]
            self.entries = entries
        elif entries != self.entries:
            raise PrimeError(f"the weights of step {step} are laid out unlike the first version published "
                             "(other tensors, shapes or dtypes)", hint=FALLBACK)
        slot = self.slots[step % SLOTS]
        with locked(slot.lock, exclusive=True, who=f"trainer publishing step {step}"):
            with torch.no_grad():
                for name, tensor in state.items():
                    view(slot.buffer, entries[name]).copy_(tensor, non_blocking=True)
            if slot.buffer.is_cuda:
                torch.cuda.synchronize(slot.buffer.device)
            from prime_core.run_dir import atomic_write_text

            atomic_write_text(slot.header, json.dumps({"step": step, "slot": step % SLOTS, "opens": slot.opens,
                                                       "tensors": entries}) + "\n")
        return announce(self.root, step, {DESCRIPTOR: json.dumps({"step": step, "slot": step % SLOTS}) + "\n"},
                        keep=self.keep)


# -- inference side ---------------------------------------------------------------------------


class Mapped:
    """A server's open slots, kept from one load to the next (opening costs more than copying)."""

    def __init__(self) -> None:
        self.buffers: dict[int, tuple[str, object]] = {}

    def buffer(self, slot: int, opens: dict, folder: Path):
        owner, buffer = self.buffers.get(slot, (None, None))
        if owner != opens["owner"]:
            self.buffers.pop(slot, None)  # a restarted trainer's slot: the old mapping goes first
            buffer = _open(opens, folder)
            self.buffers[slot] = (opens["owner"], buffer)
        return buffer


def _open(opens: dict, folder: Path):
    import torch

    from prime_plugin_transformers.weights import WeightsError

    where = f"{folder} (weight_broadcast.type = 'ipc')"
    if opens["host"] != socket.gethostname():
        raise WeightsError(f"{where}: the trainer runs on {opens['host']} and this server on "
                           f"{socket.gethostname()}; shared weights need one machine: {FALLBACK}")
    if opens["kind"] == "file":
        return torch.from_file(opens["path"], shared=True, size=opens["size"], dtype=torch.uint8)
    if not torch.cuda.is_available():
        raise WeightsError(f"{where}: the trainer's weights are on a GPU and this server sees none: {FALLBACK}")
    local = [i for i in range(torch.cuda.device_count()) if gpu_uuid(i) == opens["uuid"]]
    if not local:
        raise WeightsError(f"{where}: the trainer's GPU ({opens['uuid']}) is not visible to this server; shared "
                           f"weights need trainer and inference on the same GPU (deployment): {FALLBACK}")
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    torch.cuda._lazy_init()
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size([opens["size"]]), (1,), 0, torch.storage.TypedStorage, torch.uint8, local[0],
        bytes.fromhex(opens["handle"]), opens["bytes"], opens["offset"], False, bytes.fromhex(opens["counter"]),
        opens["counter_offset"], bytes.fromhex(opens["event"]) if opens["event"] else None, opens["event_sync"])


@contextmanager
def staged(model, folder: Path, mapped: Mapped):
    """The version in the slot ``folder`` names, as views of the shared buffer keyed by the model
    tensor each replaces (``weights.Staged``; ``step``: the version the slot holds, ``folder``'s
    or a newer one), with the slot's lock held shared until the caller has copied them in."""
    from prime_plugin_transformers.weights import Staged, WeightsError, _plan, _targets

    folder = Path(folder)
    try:
        slot = json.loads((folder / DESCRIPTOR).read_text())["slot"]
    except (OSError, ValueError, KeyError) as exc:
        raise WeightsError(f"unreadable {folder / DESCRIPTOR}: {exc}") from None
    shared = folder.parent / "shared"
    with locked(shared / f"slot_{slot}.lock", exclusive=False, who=f"inference server loading {folder}"):
        header = json.loads((shared / f"slot_{slot}.json").read_text())
        buffer = mapped.buffer(slot, header["opens"], folder)
        state, alias = _targets(model)
        tensors = header["tensors"]
        plan = _plan(state, alias, {k: tuple(v["shape"]) for k, v in tensors.items()}, folder)
        how = "CUDA IPC" if header["opens"]["kind"] == "cuda_ipc" else "a shared file"
        yield Staged({plan[k]: view(buffer, v) for k, v in tensors.items()}, f"shared through {how}, copied in place",
                     step=header["step"])
