"""The one place that creates process groups and device meshes.

Trainer processes started by torchrun (``WORLD_SIZE`` > 1) join one process group: NCCL on
GPUs, gloo on CPUs. Strategies never create groups; they receive the mesh built here, whose
named dimensions are ``dp_replicate`` (HSDP replicas) and ``dp_shard`` (FSDP shards), ``cp``
(context-parallel groups) and ``dp_mod_ep`` × ``ep`` (expert-parallel groups). Context- and
expert-parallel groups are consecutive ranks.
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
    meshes: dict[str, Any] = field(default_factory=dict)

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def from_env() -> tuple[int, int, int]:
    """``(rank, local_rank, world_size)`` as torchrun sets them (``0, 0, 1`` otherwise)."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)),
            int(os.environ.get("WORLD_SIZE", 1)))


def init() -> World:
    """Join the process group torchrun prepared (if any) and pick this rank's device."""
    import torch
    import torch.distributed as dist

    rank, local_rank, size = from_env()
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    if size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None)
    return World(rank=rank, local_rank=local_rank, size=size, device=device)


def _ensure_group(world: World) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        # A single process still gets a real (size-1) group so that every code path is the same.
        dist.init_process_group(backend="gloo" if world.device.type == "cpu" else "nccl",
                                store=dist.HashStore(), rank=0, world_size=1,
                                device_id=world.device if world.device.type == "cuda" else None)


def data_parallel_mesh(world: World, dp_replicate: int = 1):
    """The mesh FSDP shards over: 1-D ``(dp_shard,)``, or 2-D ``(dp_replicate, dp_shard)``
    for HSDP. It spans every rank (context- and expert-parallel ranks shard the dense
    parameters too). Works with one process (a mesh of size 1)."""
    from torch.distributed.device_mesh import init_device_mesh

    if world.size % dp_replicate:
        raise ValueError(f"trainer.model.dp_replicate = {dp_replicate} does not divide the "
                         f"{world.size} trainer processes")
    _ensure_group(world)
    if dp_replicate > 1:
        mesh = init_device_mesh(world.device.type, (dp_replicate, world.size // dp_replicate),
                                mesh_dim_names=("dp_replicate", "dp_shard"))
    else:
        mesh = init_device_mesh(world.device.type, (world.size,), mesh_dim_names=("dp_shard",))
    world.meshes["dp"] = mesh
    return mesh


def context_parallel_mesh(world: World, cp: int):
    """The 1-D ``cp`` mesh of this rank's context-parallel group: ``cp`` consecutive ranks,
    which share their rows (``prime_core.trainer.step``)."""
    from torch.distributed.device_mesh import init_device_mesh

    if world.size % cp:
        raise ValueError(f"trainer.model.cp = {cp} does not divide the {world.size} trainer processes")
    _ensure_group(world)
    mesh = init_device_mesh(world.device.type, (world.size // cp, cp), mesh_dim_names=("dp_cp", "cp"))["cp"]
    world.meshes["cp"] = mesh
    return mesh


def expert_mesh(world: World, ep: int):
    """The 2-D ``(dp_mod_ep, ep)`` mesh: ``ep`` consecutive ranks split the experts among
    them; ranks at the same place in different EP groups hold the same experts."""
    from torch.distributed.device_mesh import init_device_mesh

    if world.size % ep:
        raise ValueError(f"trainer.model.ep = {ep} does not divide the {world.size} trainer processes")
    _ensure_group(world)
    mesh = init_device_mesh(world.device.type, (world.size // ep, ep), mesh_dim_names=("dp_mod_ep", "ep"))
    world.meshes["ep"] = mesh
    return mesh


def mesh_for(world: World, dims: tuple[str, ...], model_config):
    """The mesh a strategy declared in ``mesh_dims`` (``None`` when it needs none)."""
    if {"dp_shard", "dp_replicate"} & set(dims):
        return world.meshes.get("dp") or data_parallel_mesh(world, model_config.dp_replicate)
    if "cp" in dims:
        return world.meshes.get("cp") or context_parallel_mesh(world, model_config.cp)
    if "ep" in dims:
        return world.meshes.get("ep") or expert_mesh(world, model_config.ep)
    return None


def cp_size(world: World) -> int:
    mesh = world.meshes.get("cp")
    return mesh.size() if mesh is not None else 1


def all_reduce(values: list[float], world: World, op: str = "sum") -> list[float]:
    """``op`` (``sum`` or ``max``) of floats over every rank (identity in a single process)."""
    if not world.distributed:
        return list(values)
    import torch
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64, device=world.device)
    dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return tensor.tolist()


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
