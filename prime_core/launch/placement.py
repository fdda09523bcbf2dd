"""GPU placement on one machine, shared by the launchers that start processes here.

GPUs are taken in order from ``CUDA_VISIBLE_DEVICES`` (or every GPU the driver lists, counted
with ``nvidia-smi -L`` so that torch is never imported): the roles in the order given
(inference first, then the trainer). A request for
more GPUs than are visible is refused with the keys that asked and the fix.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from prime_core.errors import PrimeError


@dataclass(frozen=True)
class Request:
    """``count`` GPUs for ``role``, asked for by config ``key``; explicit ``ids`` win."""

    role: str
    count: int
    key: str
    ids: tuple[str, ...] | None = None


def nvidia_smi_gpus() -> list[str] | None:
    """The GPU indices the NVIDIA driver lists (``nvidia-smi -L``), or ``None`` without a driver."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return [str(i) for i, line in enumerate(line for line in out.stdout.splitlines() if line.startswith("GPU "))]


def visible_gpus(environ: Mapping[str, str] | None = None, lister=None) -> list[str] | None:
    """The GPUs this machine offers, in order: ``CUDA_VISIBLE_DEVICES`` when set, else what
    the driver lists; ``None`` when there are none (no driver, or ``CUDA_VISIBLE_DEVICES=""``,
    which hides every GPU): the roles then run on the CPU and nothing is placed."""
    environ = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [d.strip() for d in environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()] or None
    return (lister or nvidia_smi_gpus)() or None


def assign(requests: list[Request], pool: list[str]) -> dict[str, list[str]]:
    """The GPUs of each role: explicit ``ids`` as given, the others in order from ``pool``
    (the GPUs not named explicitly). Refuses more GPUs than ``pool`` has."""
    named = {d for r in requests if r.ids is not None for d in r.ids}
    unknown = sorted(named - set(pool), key=str)
    if unknown:
        keys = ", ".join(r.key.replace("num_", "").replace("_gpus", "_gpu_ids") for r in requests if r.ids)
        raise PrimeError(f"{keys} name GPU {', '.join(unknown)}, which is not visible (visible: "
                         f"{','.join(pool) or 'none'})",
                         hint="name visible GPUs, or change CUDA_VISIBLE_DEVICES")
    free = [d for d in pool if d not in named]
    wanted = sum(r.count for r in requests if r.ids is None)
    if wanted > len(free):
        asked = " + ".join(f"{r.key} = {r.count}" for r in requests if r.ids is None and r.count)
        shown = "CUDA_VISIBLE_DEVICES=" + ",".join(pool) if "CUDA_VISIBLE_DEVICES" in os.environ else \
            f"{len(pool)} GPU(s) listed by nvidia-smi"
        raise PrimeError(
            f"this run asks for {wanted} GPUs ({asked}) but {len(free)} {'is' if len(free) == 1 else 'are'} "
            f"visible ({shown})",
            hint=f"lower {' / '.join(r.key for r in requests if r.ids is None and r.count)}, make more GPUs "
                 "visible with CUDA_VISIBLE_DEVICES" + (
                     ", or share a GPU by naming it for both roles (--deployment.inference-gpu-ids 0 "
                     "--deployment.trainer-gpu-ids 0)" if len(requests) > 1 else ""))
    out, start = {}, 0
    for r in requests:
        if r.ids is not None:
            out[r.role] = list(r.ids)
        else:
            out[r.role] = free[start:start + r.count]
            start += r.count
    return out


def shared_memory_problem(gpus: dict[str, list[str]], inference) -> PrimeError | None:
    """A GPU named for inference and for another role while ``inference.gpu_memory_utilization``
    is left at its default (0.9): the server would take nine tenths of that GPU's memory and the
    other role would run out. Set explicitly, any share is taken as meant (prime-rl's one-GPU
    example sets 0.5)."""
    if inference is None or "gpu_memory_utilization" in inference.model_fields_set:
        return None
    served = set(gpus.get("inference", []))
    sharing = [role for role, ids in gpus.items() if role != "inference" and served & set(ids)]
    if not sharing:
        return None
    shared = sorted(served & {d for role in sharing for d in gpus[role]}, key=str)
    return PrimeError(
        f"GPU {', '.join(shared)} is named for inference and for {' and '.join(sharing)}, and "
        f"inference.gpu_memory_utilization is left at its default ({inference.gpu_memory_utilization:g}): the "
        f"inference server would take that share of the GPU's memory and leave {' and '.join(sharing)} the rest",
        hint="set the share inference may take, e.g. --inference.gpu-memory-utilization 0.5 (prime-rl's one-GPU "
             "example), or give the roles GPUs of their own")


def replicas(gpus: list[str], tp: int, dp: int) -> list[list[str]]:
    """Split a role's GPUs into ``dp`` replicas of ``tp`` GPUs each (for the placement table)."""
    return [gpus[i * tp:(i + 1) * tp] for i in range(dp)]
