"""The one place that creates process groups and device meshes.

Trainer processes started by torchrun (``WORLD_SIZE`` > 1) join one process group: NCCL on
GPUs, gloo on CPUs. Strategies never create groups; they receive the meshes ``ParallelDims``
builds from every declared degree: ``dp_replicate`` × ``dp_shard`` (data parallelism) and,
per other degree ``D`` (context or expert parallelism), ``dp_mod_D`` × ``D`` (groups of ``D``
consecutive ranks).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class World:
    rank: int = 0
    local_rank: int = 0
    size: int = 1
    device: Any = "cpu"
    """``torch.device`` this rank computes on."""
    dims: ParallelDims | None = None
    """The parallel degrees and their meshes, set when the policy is built."""

    @property
    def rows_split(self) -> int:
        """How many ranks share each packed row (the context-parallel degree)."""
        return self.dims.rows_split if self.dims is not None else 1

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def from_env() -> tuple[int, int, int]:
    """``(rank, local_rank, world_size)`` as torchrun sets them (``0, 0, 1`` otherwise)."""
    rank, local_rank, size = (int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)),
                              int(os.environ.get("WORLD_SIZE", 1)))
    if not 0 <= rank < size:
        # A stray RANK (e.g. exported for something else) would make a lone process no rank 0:
        # it would train without ever publishing or logging, and its run would wait forever.
        from prime_core.errors import PrimeError

        raise PrimeError(f"the environment says RANK={rank} but WORLD_SIZE={size}",
                         hint="unset RANK (and LOCAL_RANK) in the shell that starts prime: its launchers set "
                              "them for the processes they start")
    return rank, local_rank, size


def init(timeout_seconds: float | None = None) -> World:
    """Join the process group torchrun prepared (if any) and pick this rank's device; a
    collective waits at most ``timeout_seconds`` (torch's default when unset)."""
    import torch
    import torch.distributed as dist

    rank, local_rank, size = from_env()
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    if size > 1 and not dist.is_initialized():
        dump_stacks_on_sigterm()
        backend = "nccl" if device.type == "cuda" else "gloo"
        if _one_machine_on_loopback():
            # gloo listens on the address of this host's name otherwise (a LAN address):
            # processes of one machine meet on loopback, as the rendezvous does.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        from datetime import timedelta

        timeout = timedelta(seconds=timeout_seconds) if timeout_seconds else None
        dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None, timeout=timeout)
    return World(rank=rank, local_rank=local_rank, size=size, device=device)


def dump_stacks_on_sigterm() -> None:
    """Make SIGTERM print every thread's Python stack to stderr before the process ends as it
    would have. torchrun stops the other ranks with SIGTERM when one fails, typically a rank
    that timed out in a collective another rank never reached; without this, where that other
    rank was (the one thing that explains the hang) ends with it. faulthandler's handler runs
    in C, so it prints even while the main thread is blocked inside a collective."""
    import faulthandler
    import signal

    faulthandler.register(signal.SIGTERM, file=sys.stderr, all_threads=True, chain=True)


def _one_machine_on_loopback() -> bool:
    """All ranks on this machine, meeting at a loopback address (prime's one-node torchrun)."""
    one_machine = os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE")
    return one_machine and os.environ.get("MASTER_ADDR", "").startswith("127.") and sys.platform == "linux"


def _ensure_group(world: World) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        # A single process still gets a real (size-1) group so that every code path is the same.
        dist.init_process_group(backend="gloo" if world.device.type == "cpu" else "nccl",
                                store=dist.HashStore(), rank=0, world_size=1,
                                device_id=world.device if world.device.type == "cuda" else None)


DATA_PARALLEL_DIMS = ("dp_replicate", "dp_shard")


@dataclass
class ParallelDims:
    """Every parallel degree of the trainer, checked once, and the device meshes built once.

    ``degrees`` maps mesh dimensions to sizes (``{"dp_replicate": 2, "cp": 2, "ep": 4}``), as
    the enabled strategies declare them (``ParallelStrategy.degrees``); each must divide the
    world size. Meshes:

    - ``("dp_replicate", "dp_shard")``: every rank, ``dp_replicate`` replicas of
      ``world / dp_replicate`` shards (1-D ``("dp_shard",)`` without replicas). Data
      parallelism shards every dense parameter over it, whatever the other degrees.
    - ``("dp_mod_D", "D")`` for every other degree ``D``: groups of ``D`` consecutive ranks,
      and the ranks at the same place in different groups; ``("D",)`` and ``("dp_mod_D",)``
      are its 1-D parts. Parameters a strategy shards over ``D`` (EP's experts) are sharded
      by data parallelism over ``dp_mod_D``: both are slices of one mesh, as FSDP needs.

    ``row_dim`` is the dimension whose ranks split each packed row (context parallelism).
    """

    world_size: int
    degrees: dict[str, int] = field(default_factory=dict)
    row_dim: str | None = None
    meshes: dict[tuple[str, ...], Any] = field(default_factory=dict, repr=False)

    def problems(self, prefix: str = "trainer.model", processes: str | None = None) -> list[str]:
        """One message per degree that does not divide the world size."""
        where = processes or f"{self.world_size} trainer processes"
        return [f"{prefix}.{dim} = {size} does not divide the {where}"
                for dim, size in self.degrees.items() if size > 1 and self.world_size % size]

    def size(self, dim: str) -> int:
        return self.degrees.get(dim, 1)

    @property
    def rows_split(self) -> int:
        """How many ranks share each packed row (1 without context parallelism)."""
        return self.size(self.row_dim) if self.row_dim else 1

    def build(self, world: World, requested: list[tuple[str, ...]]) -> None:
        """Build the meshes the strategies asked for, each once."""
        problems = self.problems()
        if problems:
            raise ValueError("; ".join(problems))
        for dims in requested:
            if dims:
                self.mesh(dims, world)

    def mesh(self, dims: tuple[str, ...], world: World | None = None):
        """The mesh ``dims`` names (built on first request, which needs ``world``)."""
        key = self._base(dims)
        if key not in self.meshes:
            if world is None:
                raise RuntimeError(f"no device mesh {dims} was built (ParallelDims.build first)")
            from torch.distributed.device_mesh import init_device_mesh

            _ensure_group(world)
            if key == DATA_PARALLEL_DIMS:
                replicas = self.size("dp_replicate")
                shape, names = ((replicas, self.world_size // replicas), DATA_PARALLEL_DIMS) if replicas > 1 else \
                    ((self.world_size,), ("dp_shard",))
            else:
                size = self.size(key[1])
                shape, names = (self.world_size // size, size), key
            self.meshes[key] = init_device_mesh(world.device.type, shape, mesh_dim_names=names)
        mesh = self.meshes[key]
        return mesh[dims[0]] if len(dims) == 1 and key != DATA_PARALLEL_DIMS else mesh

    @staticmethod
    def _base(dims: tuple[str, ...]) -> tuple[str, ...]:
        if set(dims) <= set(DATA_PARALLEL_DIMS):
            return DATA_PARALLEL_DIMS
        dim = dims[-1]
        if len(dims) == 1 and dim.startswith("dp_mod_") and len(dim) > len("dp_mod_"):
            return (dim, dim[len("dp_mod_"):])
        if dims not in ((dim,), (f"dp_mod_{dim}", dim)):
            raise ValueError(f"mesh dims {dims}: use {DATA_PARALLEL_DIMS}, (D,), ('dp_mod_D',) or ('dp_mod_D', 'D')")
        return (f"dp_mod_{dim}", dim)


def all_reduce(values: list[float], world: World, op: str = "sum") -> list[float]:
    """``op`` (``sum`` or ``max``) of floats over every rank (identity in a single process)."""
    if not world.distributed:
        return list(values)
    import torch

    tensor = torch.tensor(values, dtype=torch.float64, device=world.device)
    all_reduce_tensor(tensor, world, op)
    return tensor.tolist()


def all_reduce_tensor(tensor, world: World, op: str = "sum") -> None:
    """``op`` (``sum`` or ``max``) of ``tensor`` over every rank, in place; on a GPU queued
    on the device (the host does not wait)."""
    if world.distributed:
        import torch.distributed as dist

        dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])


def barrier(world: World) -> None:
    if world.distributed:
        import torch.distributed as dist

        dist.barrier()


def shutdown() -> None:
    """Leave the process group together: a rank that tears gloo down while another still
    finishes its last step can abort at exit."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def exit_process(code: int) -> None:
    """End a torchrun-started rank without interpreter finalisation.

    Gloo's C++ worker threads can still hold work objects whose tensors reference Python
    when the interpreter tears down; the rank then aborts with "terminate called without an
    active exception" (SIGABRT) after finishing its work, intermittently, even after
    ``destroy_process_group``. A multi-process rank has written and closed its outputs by
    now, so it flushes its streams and leaves with ``os._exit``. Single processes exit
    normally.
    """
    if from_env()[2] <= 1:
        raise SystemExit(code)
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


class _Tee:
    def __init__(self, *streams) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.streams[0].fileno()


def log_per_rank(world: World, log_dir: Path) -> None:
    """Every rank writes ``log_dir/rank_N.log``; only rank 0 also prints to the console.

    Other ranks redirect their file descriptors so that C++ warnings land in their log too.
    """
    if not world.distributed:
        return
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    handle = open(log_dir / f"rank_{world.rank}.log", "a", buffering=1, encoding="utf-8")  # noqa: SIM115
    if world.main:
        sys.stdout = _Tee(sys.stdout, handle)
        sys.stderr = _Tee(sys.stderr, handle)
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(handle.fileno(), 1)
    os.dup2(handle.fileno(), 2)
    sys.stdout = sys.stderr = handle
