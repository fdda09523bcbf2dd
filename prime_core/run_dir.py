"""Where a run keeps its files under ``output_dir``, and the one way they are written.

    configs/        resolved configs, one per role (``prime <role> FILE`` runs each)
    logs/           one log per role (per rank for several trainer processes)
    rollouts/step_N step batches, written atomically by the orchestrator
    weights/step_N  published weights with a STABLE marker
    checkpoints/step_N  resumable checkpoints with a COMPLETE marker
    metrics.jsonl   one line per step and role
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def atomic_write_text(path: Path, text: str) -> None:
    """Write through a temporary file and rename, so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
