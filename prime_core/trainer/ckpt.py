"""Checkpoints: ``output_dir/checkpoints/step_N/`` holds the model and optimizer state as a
torch distributed checkpoint (``state/``, one shard file per rank, loadable at any other world
size) and ``progress.json`` (the step, the world size and the distributions and versions of
prime-core and every plugin that produced it).

Every rank writes (and fsyncs) its shards into ``.step_N.tmp/``; rank 0 then writes
``progress.json``, fsyncs the folder, renames it to ``step_N`` and writes the ``COMPLETE``
marker last, so a crash mid-save leaves a folder that resuming ignores. Resuming takes the
newest checkpoint that is whole (``usable``: marker, progress, the state's metadata and every
shard file it names at its full size); a damaged newest one is skipped with a warning naming
the file, and the previous one is used.

Checkpoints are trusted input: torch's checkpoint metadata is a pickle. Rollouts (JSON) and
published weights (safetensors) are never unpickled."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import warnings
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


def problem(path: Path) -> str | None:
    """Why the checkpoint at ``path`` cannot be resumed from (naming the file at fault), or ``None``."""
    path = Path(path)
    if not (path / MARKER).exists():
        return f"{path} has no {MARKER} marker (a save that did not finish)"
    try:
        progress = json.loads((path / "progress.json").read_text())
        int(progress["step"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{path / 'progress.json'} is missing or damaged ({type(exc).__name__}: {exc})"
    state = path / "state"
    try:
        from torch.distributed.checkpoint import FileSystemReader

        metadata = FileSystemReader(str(state)).read_metadata()
    except Exception as exc:  # a damaged pickle raises anything
        return f"{state / '.metadata'} is missing or damaged ({type(exc).__name__}: {str(exc)[:200]})"
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = state / name
        size = file.stat().st_size if file.is_file() else None
        if size is None or size < end:
            return f"{file} is missing or truncated ({size or 0} bytes where the checkpoint needs {end})"
    return None


def latest_usable(output_dir: Path, *, warn=None, step: int | None = None) -> tuple[int, Path] | None:
    """The newest checkpoint that can be resumed from; each newer one that cannot is reported
    through ``warn`` (``print`` by default) with the reason, and skipped. With ``step`` (prime-rl's
    ``ckpt.resume_step``; ``-1`` is the newest) that step's checkpoint, which must be usable."""
    warn = warn or (lambda text: print(text, flush=True))
    if step is not None and step >= 0:
        from prime_core.errors import PrimeError

        found = dict(complete_checkpoints(output_dir))
        if step not in found:
            have = ", ".join(str(s) for s in sorted(found)) or "none"
            raise PrimeError(f"ckpt.resume_step = {step}: no complete checkpoint of that step under "
                             f"{checkpoints_dir(output_dir)} (complete ones: {have})",
                             hint="pick one of them, or -1 for the newest")
        reason = problem(found[step])
        if reason:
            raise PrimeError(f"ckpt.resume_step = {step}: the checkpoint cannot be resumed from: {reason}")
        return step, found[step]
    for step, path in reversed(complete_checkpoints(output_dir)):
        reason = problem(path)
        if reason is None:
            return step, path
        warn(f"warning: checkpoint step {step} is not usable: {reason}; falling back to an earlier one "
             f"(move {path} aside to silence this)")
    return None


def latest_step(output_dir: Path, *, warn=None, step: int | None = None) -> int:
    """Steps completed by the newest usable checkpoint (0 when there is none), or by that of
    ``step`` (``latest_usable``)."""
    found = latest_usable(output_dir, warn=warn, step=step)
    return found[0] if found else 0


def save(output_dir: Path, step: int, model, optimizer, progress: dict, *, world=None,
         keep_last: int | None = None, keep_interval: int | None = None) -> Path:
    """Collective: every rank writes its shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from prime_core import distributed

    world = world or distributed.World()
    path = checkpoints_dir(output_dir) / f"step_{step}"
    tmp = path.with_name(f".{path.name}.tmp")
    if world.main:
        shutil.rmtree(tmp, ignore_errors=True)
    distributed.barrier(world)
    offload = getattr(optimizer, "prime_state_offload", None)
    if offload:
        offload.to_device()  # the state's sharded layout, as the checkpoint records it
    model_state, optim_state = get_state_dict(model, optimizer)
    from prime_core.run_dir import writing

    with writing(tmp, f"the checkpoint of step {step}"):  # each rank fsyncs the files it writes
        with _single_process_quiet():
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp / "state")
    if offload:
        offload.to_host()
    distributed.barrier(world)
    if world.main:
        from prime_core.plugins import get_plugin_manager
        from prime_core.run_dir import fsync_tree, replace_dir, touch_marker

        record = {"step": step, "world_size": world.size, "plugins": get_plugin_manager().versions(), **progress}
        (tmp / "progress.json").write_text(json.dumps(record))
        fsync_tree(tmp)
        replace_dir(tmp, path)
        touch_marker(path / MARKER)
        if keep_last:
            for old_step, old in complete_checkpoints(output_dir)[:-keep_last]:
                if not (keep_interval and old_step % keep_interval == 0):
                    shutil.rmtree(old, ignore_errors=True)
    distributed.barrier(world)
    return path


@contextlib.contextmanager
def _single_process_quiet():
    """Without a process group, torch's checkpoint warns at every save and load that it assumes
    one process; a one-process trainer is one, so that line would only fill its log."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def load(path: Path, model, optimizer, *, skip_optimizer: bool = False) -> dict:
    """Restore model and optimizer (resharded to this run's layout; the model alone with
    ``skip_optimizer``); returns the progress. Collective like ``save``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from prime_core.errors import PrimeError

    if not (path / "state").is_dir():
        raise PrimeError(f"checkpoint {path} has no 'state' folder (written by an older prime?)")
    offload = getattr(optimizer, "prime_state_offload", None)
    if offload:
        offload.to_device()  # loading moves it out again (a load_state_dict hook)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state} if skip_optimizer else {"model": model_state, "optim": optim_state}
    try:
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=path / "state")
    except Exception as exc:  # damage that passed `problem` (same sizes, other bytes), or another model
        raise PrimeError(f"checkpoint {path} cannot be loaded ({type(exc).__name__}: {str(exc)[:300]})",
                         hint=f"if it is damaged, move {path} aside and resume again: the previous checkpoint "
                              "is used") from None
    if skip_optimizer:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, state["model"])
        optimizer.state.clear()  # reading the layout above filled it with a zero step
    else:
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
