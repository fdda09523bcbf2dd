"""Checkpoints: ``output_dir/checkpoints/step_N/`` holds the model (Hugging Face format), the
optimizer state and ``progress.json``; a ``COMPLETE`` marker is written last, so a crash
mid-save leaves a folder that resuming ignores."""

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


def save(output_dir: Path, step: int, model, optimizer, progress: dict, *, keep_last: int | None = None) -> Path:
    import torch

    root = checkpoints_dir(output_dir)
    path = root / f"step_{step}"
    shutil.rmtree(path, ignore_errors=True)
    model.save_pretrained(path / "model", safe_serialization=True)
    torch.save(optimizer.state_dict(), path / "optimizer.pt")
    (path / "progress.json").write_text(json.dumps({"step": step, **progress}))
    (path / MARKER).touch()
    if keep_last:
        for _, old in complete_checkpoints(output_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return path


def load(path: Path, model, optimizer) -> dict:
    """Restore model and optimizer from a checkpoint folder; returns its progress."""
    import torch
    from safetensors.torch import load_file

    state = {}
    for shard in sorted((path / "model").glob("*.safetensors")):
        state.update(load_file(shard))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"checkpoint {path} does not fit the model: missing {missing}, unexpected {unexpected}")
    if tied:
        model.tie_weights()
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    return json.loads((path / "progress.json").read_text())
