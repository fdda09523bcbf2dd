"""Checkpoints: ``output_dir/checkpoints/step_N/`` holds the model and optimizer state as a
torch distributed checkpoint (``state/``, one shard file per rank, loadable at any other world
size) and ``progress.json`` (the step, the world size and the distributions and versions of
prime-core and every plugin that produced it); a ``COMPLETE`` marker is written last, by rank 0 after every rank
has finished, so a crash mid-save leaves a folder that resuming ignores."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

MARKER = "COMPLETE"
_STEP = re.compile(r"^step_(\d+)$")


def checkpoints_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "checkpoints"


def complete_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP.match(path.name)
        if match and (path / MARKER).exists():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_step(output_dir: Path) -> int:
    """Steps completed by the newest complete checkpoint (0 when there is none)."""
    found = complete_checkpoints(output_dir)
    return found[-1][0] if found else 0


def save(output_dir: Path, step: int, model, optimizer, progress: dict, *, world=None,
         keep_last: int | None = None) -> Path:
    """Collective: every rank writes its shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from prime_core import distributed

    world = world or distributed.World()
    path = checkpoints_dir(output_dir) / f"step_{step}"
    if world.main:
        shutil.rmtree(path, ignore_errors=True)
    distributed.barrier(world)
    offload = getattr(optimizer, "prime_state_offload", None)
    if offload:
        offload.to_device()  # the state's sharded layout, as the checkpoint records it
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path / "state")
    if offload:
        offload.to_host()
    distributed.barrier(world)
    if world.main:
        from prime_core.plugins import get_plugin_manager

        record = {"step": step, "world_size": world.size, "plugins": get_plugin_manager().versions(), **progress}
        (path / "progress.json").write_text(json.dumps(record))
        (path / MARKER).touch()
        if keep_last:
            for _, old in complete_checkpoints(output_dir)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    distributed.barrier(world)
    return path


def load(path: Path, model, optimizer) -> dict:
    """Restore model and optimizer (resharded to this run's layout); returns the progress.
    Collective like ``save``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not (path / "state").is_dir():
        raise RuntimeError(f"checkpoint {path} has no 'state' folder (written by an older prime?)")
    offload = getattr(optimizer, "prime_state_offload", None)
    if offload:
        offload.to_device()  # loading moves it out again (a load_state_dict hook)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path / "state")
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return json.loads((path / "progress.json").read_text())


def plugin_changes(path: Path) -> list[str]:
    """How the plugins of this process differ from those that wrote the checkpoint at ``path``."""
    from prime_core.plugins import get_plugin_manager, version_changes

    try:
        recorded = json.loads((Path(path) / "progress.json").read_text()).get("plugins")
    except (OSError, ValueError):
        return []
    return version_changes(recorded, get_plugin_manager().versions()) if recorded else []
