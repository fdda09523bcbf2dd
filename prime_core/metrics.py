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
        with path.open("a+b") as f:
            if f.tell():  # a line torn by a crash ends without a newline: never glue a record to it
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    line = "\n" + line
            f.write(line.encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())


def parse_record(line: str) -> dict | None:
    """One JSONL line as a record, or ``None`` when it is not a JSON object (torn)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL file; lines that are not a JSON object (a line torn by a crash)
    are skipped (``drop_steps_from`` keeps them aside on resume)."""
    if not path.exists():
        return []
    with path.open(encoding="utf-8", errors="replace") as f:
        return [record for line in f if line.strip() and (record := parse_record(line)) is not None]


TORN_FILE = "metrics.torn.jsonl"


def drop_steps_from(path: Path, role: str, step: int) -> int:
    """On resume: move ``role``'s records of ``step`` and later (work that is redone) to
    ``metrics.superseded.jsonl``, and lines that are not records (torn by a crash mid-write)
    to ``metrics.torn.jsonl``, with a warning. Returns how many records were moved."""
    if not path.exists():
        return 0
    with locked(path):
        keep, moved, torn = [], [], []
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            record = parse_record(line)
            if record is None:
                torn.append((number, line))
                continue
            (moved if record.get("role") == role and record.get("step", -1) >= step else keep).append(line)
        if torn:
            with path.with_name(TORN_FILE).open("a", encoding="utf-8") as f:
                f.write("".join(line + "\n" for _, line in torn))
            lines = ", ".join(str(n) for n, _ in torn)
            print(f"warning: {path}: line {lines} was not a complete record (a crash mid-write); kept aside in "
                  f"{path.with_name(TORN_FILE)}", flush=True)
        if moved:
            with path.with_name("metrics.superseded.jsonl").open("a", encoding="utf-8") as f:
                f.write("\n".join(moved) + "\n")
        if moved or torn:
            tmp = path.with_name(path.name + ".tmp")
            with tmp.open("w", encoding="utf-8") as f:
                f.write("".join(line + "\n" for line in keep))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
    return len(moved)


def flatten(metrics: dict, prefix: str = "") -> dict[str, float | int | str | None]:
    """Nested dicts as ``"outer/inner"`` keys, so every value a monitor gets is a scalar
    (``{"env_rewards": {"a": 1.0}}`` -> ``{"env_rewards/a": 1.0}``); ``None`` means "not
    measured yet"."""
    out: dict[str, float | int | str | None] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}/"))
        elif value is None or isinstance(value, bool | int | float | str):
            out[name] = value
        elif hasattr(value, "item"):  # a 0-d tensor or numpy scalar
            out[name] = value.item()
        else:
            raise TypeError(f"metric {name!r} is a {type(value).__name__}; metrics are numbers, strings, None or "
                            "dicts of them")
    return out


def selected_monitors(config, manager) -> list[str]:
    """``jsonl`` (always), then the ``monitors`` list, then every monitor whose own plugin's
    config section ``N`` is set in this role's config (``[N]``, ``[trainer.N]``); each once."""
    names = ["jsonl", *(getattr(config, "monitors", None) or [])]
    sections = manager.registry("config_sections").values()
    names += [name for name, entry in manager.registry("monitors").items()
              if getattr(config, name, None) is not None
              and any(s.plugin == entry.plugin and s.spec.name.rsplit(".", 1)[-1] == name for s in sections)]
    return list(dict.fromkeys(names))


class MetricsLogger:
    """Writes each step's metrics to every selected monitor, prints the ``show`` keys, and
    calls ``prime_on_step_end``. Every value reaching a monitor or a hook is a scalar."""

    def __init__(self, config, *, role: str, output_dir: Path) -> None:
        from prime_core.plugins import get_plugin_manager

        manager = get_plugin_manager()
        self.sinks = [manager.select("monitors", name, key="monitors").make(config, output_dir=output_dir, role=role)
                      for name in selected_monitors(config, manager)]
        self.role = role
        self.manager = manager

    def log(self, step: int, metrics: dict, *, show: tuple[str, ...] = ()) -> None:
        metrics = flatten(metrics)
        for sink in self.sinks:
            sink.log(metrics, step)
        parts = [f"step {step}"] + [f"{k} {metrics[k]:.4g}" if isinstance(metrics[k], float) else f"{k} {metrics[k]}"
                                    for k in show if k in metrics]
        print(f"[{time.strftime('%H:%M:%S')}] " + " | ".join(parts), flush=True)
        self.manager.hook.prime_on_step_end(step=step, metrics=metrics, role=self.role)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
