"""The ``[tensorboard]`` table (top level of RL and SFT configs; the trainer and the orchestrator
get it too, a role's own ``[trainer.tensorboard]`` winning key by key)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from prime_core.config.base import Section


class TensorboardConfig(Section):
    """Write every role's metrics as TensorBoard event files, one TensorBoard run per role."""

    dir: Path = Path("tensorboard")
    """Where the event files go, relative to ``output_dir`` (an absolute path is kept); each role
    writes its own run folder inside (``trainer/``, ``orchestrator/``, ``sft/``)."""
    flush_secs: int = Field(10, ge=1)
    """At most this many seconds between a step and its events reaching the file."""
