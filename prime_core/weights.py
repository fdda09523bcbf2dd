"""The ``filesystem`` weight transport.

The trainer writes ``output_dir/weights/step_N/`` (a Hugging Face checkpoint folder, or a PEFT
adapter folder for LoRA runs, plus ``prime_plugins.json``: the distributions and versions of
prime-core and the plugins that produced it) through a temporary name, renames it and writes a
``STABLE`` marker last; the orchestrator only ever loads folders with the marker, so a
half-written checkpoint is never served. Old versions are pruned, keeping the newest few.

The folder is fsynced after the marker, not before: servers read it from the page cache, and
waiting for the disk first cost seconds of every update's latency (3.4 GB: 1.5 s alone, more
while training writes). Durability is still where resuming needs it: the trainer joins a
step's publish, fsync included, before checkpointing that step, and on resume drops published
versions newer than the checkpoint and publishes the checkpoint's own again.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

MARKER = "STABLE"
_STEP = re.compile(r"^step_(\d+)$")


def weights_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "weights"


class FilesystemPublisher:
    def __init__(self, config=None, *, output_dir: Path, keep: int = 3) -> None:
        self.root = weights_dir(output_dir)
        self.keep = keep

    def publish(self, model, step: int, state_dict: dict | None = None) -> Path:
        """Write ``model`` (its config, and ``state_dict`` when given: the full tensors a
        sharded model gathered) as a Hugging Face folder for policy version ``step``."""
        from prime_core.run_dir import fsync_tree, replace_dir, touch_marker, writing

        final = self.root / f"step_{step}"
        tmp = self.root / f".step_{step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        with writing(tmp, f"the weights of step {step}"):
            if isinstance(state_dict, Adapter):
                state_dict.save(tmp)
            else:
                model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
            record_plugins(tmp)
        replace_dir(tmp, final)
        touch_marker(final / MARKER)
        fsync_tree(final)  # after the marker: see the module's docstring
        prune(self.root, step, self.keep)
        return final


def prune(root: Path, newest: int, keep: int) -> None:
    """Remove the published versions ``keep`` or more steps older than ``newest``."""
    for step, path in versions(root):
        if step <= newest - keep:
            shutil.rmtree(path, ignore_errors=True)


def announce(root: Path, step: int, files: dict[str, str], *, keep: int) -> Path:
    """``root/step_N`` holding ``files`` (name -> text: a transport's descriptor of where version
    N's tensors are, for the transports that do not publish files), marked ``STABLE`` as a
    published folder is (the orchestrator's loader finds it the same way); older versions pruned."""
    from prime_core.run_dir import replace_dir, touch_marker, writing

    final, tmp = root / f"step_{step}", root / f".step_{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with writing(tmp, f"the announcement of step {step}"):
        tmp.mkdir(parents=True)
        for name, text in files.items():
            (tmp / name).write_text(text)
        record_plugins(tmp)
    replace_dir(tmp, final)
    touch_marker(final / MARKER)
    prune(root, step, keep)
    return final


class FilesystemLoader:
    def __init__(self, config=None, *, output_dir: Path) -> None:
        self.root = weights_dir(output_dir)

    def latest(self) -> tuple[int, Path] | None:
        ready = [(s, p) for s, p in versions(self.root) if (p / MARKER).exists()]
        return max(ready) if ready else None


PLUGINS_FILE = "prime_plugins.json"


def record_plugins(folder: Path) -> None:
    """Write which prime-core and plugin versions produced the model in ``folder``."""
    import json

    from prime_core.plugins import get_plugin_manager

    (Path(folder) / PLUGINS_FILE).write_text(json.dumps(get_plugin_manager().versions(), indent=2) + "\n")


def host_copy(tensor, buffers: dict, key: str, *, pin: bool):
    """``tensor`` copied into ``buffers[key]``, a host tensor kept from one call to the next
    (pinned for copies to or from a GPU: pinning gigabytes anew each time costs more than the
    copy). A copy from a GPU is asynchronous: synchronize before reading the buffer."""
    import torch

    buffer = buffers.get(key)
    if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
        buffer = buffers[key] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
    return buffer.copy_(tensor, non_blocking=tensor.is_cuda)


def versions(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    out = []
    for path in root.iterdir():
        match = _STEP.match(path.name)
        if match and path.is_dir():
            out.append((int(match.group(1)), path))
    return sorted(out)


def remove_after(output_dir: Path, step: int) -> None:
    """On resume: drop published weights newer than the checkpoint we continue from."""
    for s, path in versions(weights_dir(output_dir)):
        if s > step:
            shutil.rmtree(path, ignore_errors=True)


class Adapter:
    """A LoRA adapter to publish instead of full weights: PEFT tensor names and config."""

    CONFIG = "adapter_config.json"
    WEIGHTS = "adapter_model.safetensors"

    def __init__(self, tensors: dict, config: dict) -> None:
        self.tensors = tensors
        self.config = config

    def save(self, path: Path) -> None:
        import json

        from safetensors.torch import save_file

        path.mkdir(parents=True, exist_ok=True)
        save_file(self.tensors, str(path / self.WEIGHTS))
        (path / self.CONFIG).write_text(json.dumps(self.config, indent=2) + "\n")


def is_adapter(path: Path) -> bool:
    """Whether a published folder holds a LoRA adapter (rather than full weights)."""
    return (Path(path) / Adapter.CONFIG).is_file()
