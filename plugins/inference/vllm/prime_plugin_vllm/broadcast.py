"""The ``nccl`` weight transport: each new policy version goes from trainer rank 0 straight
into every inference worker over one process group (NCCL on GPUs, gloo on CPUs), in buckets,
with no safetensors round trip.

Who does what, for version N (``docs/deployment.md``, "Weight broadcast"):

1. **Trainer rank 0** (``BroadcastPublisher.publish``). On its first publish it starts the
   group's rendezvous, a ``TCPStore`` on ``weight_broadcast.host``/``port`` (port 0, the
   default: a free port). It writes ``weights/step_N/BROADCAST.json`` (the store's address,
   the group's id and size, the step) through a temporary name, then the ``STABLE`` marker,
   and waits (``weight_broadcast.timeout``) for ``inference_world_size`` inference workers to
   join; then it sends N's header and buckets. ``publish`` returns when the last bucket is sent.
2. **Orchestrator**. Its loader (``BroadcastLoader``) finds ``step_N`` with its marker as the
   filesystem loader does, and it asks every engine to load it, all at once; the vllm client
   sees ``BROADCAST.json`` and calls the worker extension's ``prime_receive_weights`` through
   ``POST /collective_rpc``, then resets the prefix cache.
3. **Each inference worker** (``Receiver``): the first time, or when the group id changed (a
   restarted trainer), it connects to the store, claims a rank (1..W) and joins the group;
   then it receives N's header and buckets and loads them into vLLM as they arrive.

The trainer blocks on each version, so inference receives every version in order
(``WeightTransport.loads_every_version``): the orchestrator loads the last one too before it
exits. The group's rendezvous address travels in the descriptor file on the filesystem the
roles already share (rollouts go that way), so no side needs another's address in its config.

Failures never hang a side: every wait (join, header, bucket) has ``weight_broadcast.timeout``
and the error names the side that did not answer (the trainer, or which receivers are missing).

LoRA runs publish adapters through the filesystem (``FilesystemPublisher``), as prime-rl does:
an adapter is small, and vLLM loads adapters from a folder.

Wire format of one version: an int64 tensor ``[header bytes]``, the header (uint8: JSON with
the step and, per bucket, each tensor's name, dtype and shape), then one uint8 buffer per
bucket holding its tensors' bytes back to back. Nothing here imports vLLM: the trainer side
needs torch only.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import time
import uuid
from datetime import timedelta
from pathlib import Path

from prime_core.errors import PrimeError

DESCRIPTOR = "BROADCAST.json"
RANKS_KEY = "prime/ranks"
DEFAULT_TIMEOUT = 1200.0
DEFAULT_BUCKET_MB = 256


def is_broadcast(path) -> bool:
    """Whether a published version folder is announced for the broadcast (not files to load)."""
    return (Path(path) / DESCRIPTOR).is_file()


def read_descriptor(path) -> dict:
    path = Path(path)
    return json.loads((path / DESCRIPTOR if path.is_dir() else path).read_text())


def backend_for(device) -> str:
    import torch

    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def make_group(store, rank: int, size: int, *, device, timeout: float, host: str):
    """A process group of ``size`` over ``store`` outside torch.distributed's default group (the
    trainer and vLLM each have their own): NCCL for CUDA devices, gloo otherwise. ``host`` is
    the rendezvous's address: when it is loopback, gloo's own connections stay on loopback too."""
    import torch.distributed as dist

    if backend_for(device) == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=timeout)
        return dist.ProcessGroupNCCL(store, rank, size, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=timeout)
    loopback = host in ("127.0.0.1", "localhost", "::1")
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1") if loopback
                        else dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(store, rank, size, options)


def _broadcast(group, tensor, timeout: float):
    """Start broadcasting ``tensor`` from rank 0; returns the work to ``wait()`` for."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    options.timeout = timedelta(seconds=timeout)
    return group.broadcast([tensor], options)


def buckets(state: dict, bucket_bytes: int) -> list[list[tuple[str, object]]]:
    """``state``'s tensors in order, grouped into buckets of about ``bucket_bytes`` (a tensor
    larger than that is a bucket of its own)."""
    out: list[list] = [[]]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if out[-1] and size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append((name, tensor))
        size += nbytes
    return [b for b in out if b]


def unique_tensors(state: dict) -> dict:
    """``state`` with tied tensors (one storage under two names, ``lm_head`` and the
    embeddings) sent once, under their first name, as ``save_pretrained`` writes them."""
    seen, out = set(), {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if tensor.device.type != "meta" and key in seen:
            continue
        seen.add(key)
        out[name] = tensor
    return out


class BucketBuffers:
    """Byte buffers for a side's buckets, reused from one bucket and one version to the next on a
    CPU. A fresh buffer of a few hundred MB is paid for in page faults as it is first written (on
    2 cores, 961 MiB to two receivers over gloo took 1.4 s into fresh buffers, 0.7 s into reused
    ones). A buffer is handed out again only once nothing else holds a view of it: a receiver's
    consumer may keep tensors of a bucket (vLLM's layerwise reload holds a layer's tensors until
    the layer is whole, which can span two buckets), and then a new buffer is taken. On a GPU the
    caching allocator already reuses memory, and a held buffer would take it from training or
    the KV cache: every bucket gets its own there."""

    def __init__(self, device, keep: int = 2) -> None:
        import torch

        self.device = torch.device(device)
        self.keep = keep if self.device.type == "cpu" else 0
        self._held: list[tuple[object, int]] = []  # (buffer, its storage's use count when unshared)

    def take(self, nbytes: int):
        """A ``uint8`` tensor of ``nbytes`` no one else uses."""
        import torch

        for buffer, alone in self._held:
            if buffer.numel() >= nbytes and _use_count(buffer) == alone:
                return buffer[:nbytes]
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        count = _use_count(buffer) if self.keep else None
        if count is not None:
            if len(self._held) >= self.keep:  # every held one is in use: replace the smallest
                self._held.pop(min(range(len(self._held)), key=lambda i: self._held[i][0].numel()))
            self._held.append((buffer, count))
        return buffer[:nbytes]  # a view: while the caller holds it, the count shows the buffer in use


def _use_count(tensor) -> int | None:
    """How many tensors (views included) share ``tensor``'s storage, as torch counts them; ``None``
    where this torch cannot tell (then no buffer is reused)."""
    import torch

    count = getattr(torch._C, "_storage_Use_Count", None)
    return None if count is None else int(count(tensor.untyped_storage()._cdata))


# -- trainer side -----------------------------------------------------------------------------


class Sender:
    """Trainer rank 0: the store and the group, then one ``send`` per version."""

    def __init__(self, *, host: str | None, port: int, world_size: int, device, timeout: float) -> None:
        from torch.distributed import PrefixStore, TCPStore

        self.timeout = timeout
        self.world_size = world_size
        self.device = device
        self.group_id = uuid.uuid4().hex[:12]
        # TCPStore's own server listens on every interface whatever host it is given: listen on
        # a socket bound to ``host`` instead (every interface only when no host is set).
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host or "0.0.0.0", port))
        listener.listen(128)
        self.address, self.port = listener.getsockname()
        # The store's server owns the socket from here: Python must never close it under it.
        self.store = TCPStore(host or "127.0.0.1", self.port, world_size=None, is_master=True,
                              timeout=timedelta(seconds=timeout), wait_for_workers=False,
                              master_listen_fd=listener.detach(), use_libuv=False)
        self.host = host or _reachable_host()
        self.prefix = PrefixStore(f"prime/{self.group_id}/", self.store)
        self.group = None
        self.buffers = BucketBuffers(device)
        atexit.register(self.close)

    def close(self) -> None:
        self.group = None

    def descriptor(self, step: int) -> dict:
        return {"host": self.host, "port": self.port, "group": self.group_id, "world_size": self.world_size,
                "backend": backend_for(self.device), "timeout": self.timeout, "step": step}

    def joined(self) -> int:
        return int(self.prefix.add(RANKS_KEY, 0))

    def receivers(self) -> str:
        """Who joined: ``rank: server`` for every rank that said where it serves."""
        names = []
        for rank in range(1, self.world_size):
            try:
                self.prefix.wait([f"who/{rank}"], timedelta(seconds=0.01))
                names.append(f"rank {rank}: {self.prefix.get(f'who/{rank}').decode()}")
            except Exception:
                names.append(f"rank {rank}: not joined")
        return "; ".join(names)

    def connect(self, step: int) -> None:
        """Wait for every inference worker to join (``timeout``), then build the group."""
        deadline = time.monotonic() + self.timeout
        expected = self.world_size - 1
        while self.joined() < expected:
            if time.monotonic() > deadline:
                raise PrimeError(
                    f"weight broadcast of policy v{step}: {self.joined()} of {expected} inference worker(s) joined "
                    f"the group at {self.host}:{self.port} within {self.timeout:g} s (weight_broadcast.timeout); "
                    "the inference side never asked for the weights",
                    hint="the orchestrator has every inference server join when it finds "
                         f"weights/step_{step}/{DESCRIPTOR}: see its log and the inference logs; "
                         "weight_broadcast.inference_world_size must be the number of inference workers "
                         "(replicas x tensor parallel)")
            time.sleep(0.05)
        self.group = make_group(self.prefix, 0, self.world_size, device=self.device, timeout=self.timeout,
                                host=self.host)

    def send(self, step: int, state: dict, bucket_bytes: int) -> int:
        """Version ``step``'s tensors to every receiver; returns the bytes sent."""
        import torch

        if self.group is None:
            self.connect(step)
        parts = buckets(unique_tensors(state), bucket_bytes)
        header = {"step": step, "buckets": [[(name, str(t.dtype).removeprefix("torch."), list(t.shape))
                                             for name, t in part] for part in parts]}
        raw = json.dumps(header).encode()
        sent = 0
        try:
            self._send(torch.tensor([len(raw)], dtype=torch.int64)).wait()
            self._send(torch.frombuffer(bytearray(raw), dtype=torch.uint8)).wait()
            # One bucket in flight while the next is packed (and, on the receivers, while the
            # previous one loads): the transfer overlaps the work on both sides.
            pending = None
            for part in parts:
                pieces = [t.detach().to(self.device).contiguous().reshape(-1).view(torch.uint8) for _, t in part]
                flat = torch.cat(pieces, out=self.buffers.take(sum(p.numel() for p in pieces)))
                del pieces
                work = self._send(flat)
                if pending is not None:
                    pending[0].wait()
                    sent += pending[1]
                pending = (work, flat.numel(), flat)
            if pending is not None:
                pending[0].wait()
                sent += pending[1]
            if torch.device(self.device).type == "cuda":  # NCCL's wait() only orders streams: sent means sent
                torch.cuda.synchronize(self.device)
        except Exception as exc:
            raise PrimeError(
                f"weight broadcast of policy v{step} failed after {sent} bytes: an inference worker stopped "
                f"receiving ({type(exc).__name__}: {str(exc).strip()[:500]}); receivers: {self.receivers()}",
                hint="see the inference logs under output_dir/logs/ (vllm-PORT.log): a server that died or hung "
                     "mid-broadcast stops the run; weight_broadcast.timeout bounds the wait") from None
        return sent

    def _send(self, tensor):
        return _broadcast(self.group, tensor.to(self.device), self.timeout)


def trainer_device(model, state: dict):
    """Where the trainer computes, which decides the group (NCCL or gloo): its parameters'
    device. The tensors it publishes are host copies (the version never sits whole on the GPU;
    each bucket goes back to the device to be sent)."""
    for param in model.parameters() if model is not None else ():
        if param.device.type != "meta":
            return param.device
        break
    return next(iter(state.values())).device if state else "cpu"


def _reachable_host() -> str:
    """This machine's name, which inference workers on other machines resolve to it (set
    ``weight_broadcast.host`` where they reach it by another address)."""
    return socket.gethostname()


class BroadcastPublisher:
    """The trainer's publisher (rank 0). Full weights go over the group; LoRA adapters through
    the filesystem."""

    def __init__(self, config=None, *, output_dir: Path, keep: int = 3) -> None:
        from prime_core.weights import weights_dir

        self.config = getattr(config, "weight_broadcast", None)
        self.output_dir = Path(output_dir)
        self.root = weights_dir(output_dir)
        self.keep = keep
        self.sender: Sender | None = None
        self._filesystem = None

    def _setting(self, key: str, default):
        value = getattr(self.config, key, None)
        return default if value is None else value

    def publish(self, model, step: int, state_dict=None) -> Path:
        from prime_core.weights import Adapter, FilesystemPublisher

        if isinstance(state_dict, Adapter):
            if self._filesystem is None:
                print("weight_broadcast.type = 'nccl': LoRA adapters are published through the filesystem "
                      "(weights/step_N/), as with type = 'filesystem'", flush=True)
                self._filesystem = FilesystemPublisher(output_dir=self.output_dir, keep=self.keep)
            return self._filesystem.publish(model, step, state_dict)
        state = state_dict if state_dict is not None else model.state_dict()
        if self.sender is None:
            self.sender = self._start(model, state)
        final = self._announce(step)
        start = time.perf_counter()
        sent = self.sender.send(step, state, int(self._setting("bucket_mb", DEFAULT_BUCKET_MB) * 1024**2))
        print(f"broadcast policy v{step}: {sent / 1024**2:.1f} MiB to {self.sender.world_size - 1} inference "
              f"worker(s) in {time.perf_counter() - start:.2f} s", flush=True)
        return final

    def _start(self, model, state: dict) -> Sender:
        world = self._setting("inference_world_size", None)
        if world is None:
            raise PrimeError("weight_broadcast.type = 'nccl' needs the number of inference workers that receive "
                             "the weights: weight_broadcast.inference_world_size is not set",
                             hint="`prime run` sets it from inference.parallel (dp x tp); for a trainer started "
                                  "alone, set --weight-broadcast.inference-world-size")
        device = trainer_device(model, state)
        sender = Sender(host=self._setting("host", None), port=int(self._setting("port", 0)), world_size=world + 1,
                        device=device, timeout=float(self._setting("timeout", DEFAULT_TIMEOUT)))
        print(f"weight broadcast: {backend_for(device)} group '{sender.group_id}' at {sender.host}:{sender.port} "
              f"for {world} inference worker(s)", flush=True)
        return sender

    def _announce(self, step: int) -> Path:
        """``weights/step_N/BROADCAST.json`` then ``STABLE``: the orchestrator's cue to have the
        servers receive version N."""
        from prime_core.weights import announce

        return announce(self.root, step, {DESCRIPTOR: json.dumps(self.sender.descriptor(step), indent=2) + "\n"},
                        keep=self.keep)


class BroadcastLoader:
    """The orchestrator's view: the newest announced version (a LoRA run's adapter folders too)."""

    def __init__(self, config=None, *, output_dir: Path) -> None:
        from prime_core.weights import FilesystemLoader

        self._files = FilesystemLoader(config, output_dir=output_dir)

    def latest(self):
        return self._files.latest()


# -- inference side ---------------------------------------------------------------------------


class Receiver:
    """One inference worker's membership of the group."""

    def __init__(self, descriptor: dict, *, device, label: str) -> None:
        from torch.distributed import PrefixStore, TCPStore

        self.descriptor = descriptor
        self.group_id = descriptor["group"]
        self.timeout = float(descriptor["timeout"])
        self.device = device
        where = f"{descriptor['host']}:{descriptor['port']}"
        if backend_for(device) == "nccl":
            import torch

            torch.cuda.set_device(device)  # NCCL works on the current device
        if descriptor["backend"] != backend_for(device):
            raise RuntimeError(f"the trainer broadcasts over {descriptor['backend']} and this inference worker runs "
                               f"on {device} ({backend_for(device)}): trainer and inference must both use GPUs "
                               "or both CPUs for weight_broadcast.type = 'nccl'")
        try:
            store = TCPStore(descriptor["host"], int(descriptor["port"]), is_master=False,
                             timeout=timedelta(seconds=min(self.timeout, 60.0)))
        except Exception as exc:
            raise RuntimeError(f"cannot reach the trainer's weight broadcast at {where} ({exc}): the trainer "
                               "stopped, or this machine cannot reach that address (weight_broadcast.host)") from None
        self.prefix = PrefixStore(f"prime/{self.group_id}/", store)
        self.rank = int(self.prefix.add(RANKS_KEY, 1))
        size = int(descriptor["world_size"])
        if self.rank >= size:
            raise RuntimeError(f"weight broadcast: more inference workers joined than "
                               f"weight_broadcast.inference_world_size = {size - 1} says: set it to the number of "
                               "inference workers (replicas x tensor parallel)")
        self.prefix.set(f"who/{self.rank}", f"{label} (pid {os.getpid()})")
        self.buffers = BucketBuffers(device)
        # A gloo group still alive when the interpreter tears down aborts the process
        # ("terminate called without an active exception"): drop it first.
        atexit.register(self.close)
        try:
            self.group = make_group(self.prefix, self.rank, size, device=device, timeout=self.timeout,
                                    host=descriptor["host"])
        except Exception as exc:
            raise RuntimeError(f"joining the weight broadcast group at {where} as rank {self.rank} failed: {exc}; "
                               "the trainer (rank 0) or another inference worker did not join in "
                               f"{self.timeout:g} s (weight_broadcast.timeout)") from None

    def close(self) -> None:
        self.group = self.prefix = None

    def receive(self, step: int):
        """Yield ``(name, tensor)`` of version ``step`` as its buckets arrive."""
        import torch

        try:
            size = torch.zeros(1, dtype=torch.int64, device=self.device)
            self._recv(size).wait()
            raw = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
            self._recv(raw).wait()
            header = json.loads(bytes(raw.cpu().numpy()))
        except Exception as exc:
            raise self._failed(step, exc) from None
        if header["step"] != step:
            raise RuntimeError(f"weight broadcast: asked to receive policy v{step} but the trainer sends "
                               f"v{header['step']}: the orchestrator and the trainer are out of step")
        layouts = []
        for part in header["buckets"]:
            dtypes = [getattr(torch, dtype) for _, dtype, _ in part]
            sizes = [_numel(shape) * torch.empty(0, dtype=dt).element_size()
                     for (_, _, shape), dt in zip(part, dtypes, strict=True)]
            layouts.append((part, dtypes, sizes))

        def post(index: int):
            flat = self.buffers.take(sum(layouts[index][2]))
            return flat, self._recv(flat)

        # The next bucket arrives while vLLM loads this one (the trainer keeps one in flight). It
        # is asked for once this one's first tensor is handed out: by then the consumer holds
        # nothing of the bucket before, whose buffer can take it.
        incoming = post(0) if layouts else None
        for index, (part, dtypes, sizes) in enumerate(layouts):
            flat, work = incoming
            incoming = None
            try:
                work.wait()
            except Exception as exc:
                raise self._failed(step, exc) from None
            offset = 0
            for (name, _, shape), dtype, nbytes in zip(part, dtypes, sizes, strict=True):
                yield name, flat[offset:offset + nbytes].view(dtype).view(shape)
                offset += nbytes
                if incoming is None and index + 1 < len(layouts):
                    try:
                        incoming = post(index + 1)
                    except Exception as exc:
                        raise self._failed(step, exc) from None

    def _recv(self, tensor):
        return _broadcast(self.group, tensor, self.timeout)

    def _failed(self, step: int, exc: Exception) -> RuntimeError:
        where = f"{self.descriptor['host']}:{self.descriptor['port']}"
        return RuntimeError(f"receiving policy v{step} from the trainer ({where}, rank 0) failed: "
                            f"{type(exc).__name__}: {str(exc).strip()[:500]}; the trainer stopped sending (it died, "
                            f"or hung past weight_broadcast.timeout = {self.timeout:g} s): see the trainer's log")


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
