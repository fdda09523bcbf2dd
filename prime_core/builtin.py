"""The core's built-in plugin: defaults that need no extra dependency, registered through the
same hooks and entry-point group as any third-party plugin (name ``core``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from prime_core import hookimpl
from prime_core.specs import Monitor

PRIME_PLUGIN_API = 1


class JsonlMonitor:
    """Appends one JSON object per step to ``<output_dir>/metrics.jsonl``.

    Each line is flushed and fsynced, so a crash loses at most the step being written.
    """

    def __init__(self, config=None, *, output_dir: str | Path, role: str) -> None:
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.role = role
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, metrics: dict, step: int) -> None:
        record = {"step": step, "role": self.role, **metrics}
        self._file.write(json.dumps(record, default=float) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


@hookimpl
def prime_monitors():
    return [Monitor(name="jsonl", make=JsonlMonitor, description="metrics.jsonl under output_dir")]
