"""The ``[wandb]`` table: prime-rl's keys (0.5 / 0.6), plus ``id`` and ``dir``.

At the top of an RL config it reaches the trainer and the orchestrator (a role's own
``[trainer.wandb]`` / ``[orchestrator.wandb]`` wins key by key); in an SFT config it is the
SFT run's. Its presence turns the ``wandb`` monitor on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field

from prime_core.config.base import Noted, Section, Toggle


class LogExtrasConfig(Section):
    """prime-rl's ``log_extras`` (the orchestrator's sample tables and distributions). Accepted so
    that prime-rl configs load unchanged; prime's monitors receive scalar metrics only, so
    nothing beyond the scalars is logged (the role's log says so when the table is set)."""

    samples: bool = True
    """Log prompt/response samples (not logged by prime)."""
    distributions: bool = True
    """Log distributions such as rewards and advantages (not logged by prime)."""
    interval: int = Field(10, ge=1)
    """Step interval between extras."""
    sample_ratio: float | None = Field(None, ge=0.0, le=1.0)
    """Fraction of rollouts to log per step."""


class WandbConfig(Section):
    """Log metrics to Weights & Biases. In an RL run the trainer and the orchestrator share one
    W&B run; each role's metrics are logged as ``<role>/<metric>`` against ``<role>/step``."""

    project: str = "prime"
    """W&B project."""
    entity: str | None = None
    """W&B entity (user or team); ``None``: your default entity."""
    name: str | None = None
    """Run name; ``None``: the name of ``output_dir``. With ``shared = false`` each role's run
    gets ``-trainer`` / ``-orchestrator`` appended."""
    group: str | None = None
    """W&B group, to show several runs together."""
    tags: list[str] | None = None
    """Tags attached to the run."""
    id: str | None = None
    """Run id. ``None``: a new id, kept in ``output_dir/logs/wandb-run-id`` so that the roles of one
    run, and a ``--resume`` of it, log into the same W&B run. Set it to continue a given run."""
    dir: Path | None = None
    """Where wandb keeps its local files (a ``wandb/`` folder is created inside); relative paths
    are relative to ``output_dir``. ``None``: ``output_dir``."""
    offline: bool = False
    """Write the run locally only (upload later with ``wandb sync``). Without an API key or
    without network, the monitor runs offline anyway and says so."""
    shared: bool = True
    """The trainer and the orchestrator log into one run (prime-rl 0.5's ``wandb.shared``);
    ``false``: one run per role, named ``<name>-<role>``."""
    log_extras: Annotated[Toggle[LogExtrasConfig], Noted(
        "prime's monitors log scalar metrics only: no sample tables or distributions")] = None
    """prime-rl's sample and distribution logging: accepted for compatibility, not logged."""
