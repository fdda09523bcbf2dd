"""Per-step metrics: every role logs through ``MetricsLogger``, which writes to the selected
monitors (``metrics.jsonl`` always) and prints one line per step to the role's log.

``metrics.jsonl`` is shared by the roles of a run. Appends and the rewrite done on resume
(``drop_steps_from``) hold a lock file, so two roles never interleave or lose lines.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import time
from contextlib import contextmanager
from pathlib import Path

METRICS_FILE = "metrics.jsonl"


@contextmanager
def locked(path: Path):
    lock = path.with_name(path.name + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def append_jsonl(path: Path, record: dict) -> None:
    line = json.dumps({k: _clean(v) for k, v in record.items()}, default=float) + "\n"
    with locked(path):
        with path.open("a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def drop_steps_from(path: Path, role: str, step: int) -> int:
    """On resume: move ``role``'s records of ``step`` and later (work that is redone) to
    ``metrics.superseded.jsonl``. Returns how many were moved."""
    if not path.exists():
        return 0
    with locked(path):
        keep, moved = [], []
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            (moved if record.get("role") == role and record.get("step", -1) >= step else keep).append(line)
        if moved:
            with path.with_name("metrics.superseded.jsonl").open("a", encoding="utf-8") as f:
                f.write("\n".join(moved) + "\n")
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in keep), encoding="utf-8")
            os.replace(tmp, path)
    return len(moved)


def configured_monitors(config, manager) -> list[str]:
    """Monitors a role's config switches on: a plugin's monitor ``N`` is used by every role
    whose config holds that plugin's own config section ``N`` (``[N]``, ``[trainer.N]``, ...)."""
    sections = manager.registry("config_sections").values()
    return [name for name, entry in manager.registry("monitors").items()
            if getattr(config, name, None) is not None
            and any(s.plugin == entry.plugin and s.spec.name.rsplit(".", 1)[-1] == name for s in sections)]


class MetricsLogger:
    def __init__(self, config, *, role: str, output_dir: Path, monitors: tuple[str, ...] = ("jsonl",)) -> None:
        from prime_core.plugins import get_plugin_manager

        manager = get_plugin_manager()
        names = list(monitors) + (["wandb"] if getattr(config, "wandb", None) is not None else [])
        names += [n for n in configured_monitors(config, manager) if n not in names]
        self.sinks = [manager.select("monitors", n, key="monitors").make(config, output_dir=output_dir, role=role)
                      for n in names]
        self.role = role
        self.manager = manager

    def log(self, step: int, metrics: dict, *, show: tuple[str, ...] = ()) -> None:
        for sink in self.sinks:
            sink.log(metrics, step)
        parts = [f"step {step}"] + [f"{k} {metrics[k]:.4g}" if isinstance(metrics[k], float) else f"{k} {metrics[k]}"
                                    for k in show if k in metrics]
        print(f"[{time.strftime('%H:%M:%S')}] " + " | ".join(parts), flush=True)
        self.manager.hook.prime_on_step_end(step=step, metrics=metrics, role=self.role)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
