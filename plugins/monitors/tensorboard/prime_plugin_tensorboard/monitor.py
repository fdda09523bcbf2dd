"""The ``tensorboard`` monitor: each role's metrics as TensorBoard event files.

Each role is a TensorBoard *run*: ``<output_dir>/tensorboard/<role>/events.out.tfevents.*``, so
``tensorboard --logdir <output_dir>/tensorboard`` shows the trainer, the orchestrator (or the
SFT run) side by side, with the metric names as tags (``loss``, ``env_rewards/arithmetic``).
Numbers are scalars; strings are text summaries; the role's config is a text summary
(``config``) at its first step.

A role that finds event files of an earlier process in its folder (``--resume``, or a
``--clean`` run in the same ``output_dir``) starts with a ``SessionLog.START`` event at its
first step: TensorBoard then drops the older events from that step on, so redone steps replace
the old ones instead of drawing a second line (as ``metrics.jsonl`` does on resume).

Written with tensorboard's own event writer: no TensorFlow, no torch. Imported on first use,
never when the plugin is loaded.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

from prime_core.errors import PrimeError


def missing() -> str | None:
    """``available()``: why the monitor cannot run here, or ``None``."""
    if importlib.util.find_spec("tensorboard") is None:
        return ("the tensorboard package is not installed: pip install prime-plugin-tensorboard "
                "(or pip install tensorboard)")
    return None


class TensorboardMonitor:
    """``make(config, *, output_dir, role)`` of the ``tensorboard`` monitor (see the module doc)."""

    def __init__(self, config=None, *, output_dir: str | Path, role: str) -> None:
        from prime_plugin_tensorboard.config import TensorboardConfig

        cfg = getattr(config, "tensorboard", None) or TensorboardConfig()
        try:
            from tensorboard.compat.proto.event_pb2 import Event, SessionLog
            from tensorboard.compat.proto.summary_pb2 import Summary
            from tensorboard.plugins.text.summary_v2 import text_pb
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError as exc:
            raise PrimeError(f"the tensorboard monitor needs the tensorboard package ({exc})",
                             hint="pip install prime-plugin-tensorboard") from None
        self._event, self._session_log, self._summary, self._text = Event, SessionLog, Summary, text_pb
        self.root = (Path(output_dir) / cfg.dir).resolve()
        self.logdir = self.root / role
        try:
            self.logdir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise PrimeError(f"tensorboard.dir: cannot create {self.logdir}: {exc}") from None
        self.earlier = sorted(p.name for p in self.logdir.glob("events.out.tfevents.*"))
        self.writer = EventFileWriter(str(self.logdir), flush_secs=cfg.flush_secs)
        self.config_text = (json.dumps(config.model_dump(mode="json"), indent=2)
                            if hasattr(config, "model_dump") else None)
        self.first = True
        print(f"[{time.strftime('%H:%M:%S')}] tensorboard ({role}): writing {role} metrics to {self.logdir}; "
              f"view them with: tensorboard --logdir {self.root}", flush=True)

    def _write(self, step: int, **fields) -> None:
        self.writer.add_event(self._event(wall_time=time.time(), step=step, **fields))

    def log(self, metrics: dict, step: int) -> None:
        if self.first:
            self.first = False
            if self.earlier:  # drop what earlier processes logged from this step on
                self._write(step, session_log=self._session_log(status=self._session_log.START))
            if self.config_text is not None:
                self._write(step, summary=self._text("config", f"```\n{self.config_text}\n```"))
        values = []
        for tag, value in metrics.items():
            if value is None:  # not measured yet: TensorBoard has no empty value, so nothing is written
                continue
            if isinstance(value, str):
                values.extend(self._text(tag, value).value)
            else:
                values.append(self._summary.Value(tag=tag, simple_value=float(value)))
        self._write(step, summary=self._summary(value=values))

    def close(self) -> None:
        self.writer.close()
