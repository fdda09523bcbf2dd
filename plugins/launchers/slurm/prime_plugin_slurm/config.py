"""The ``[slurm]`` table, with the keys of prime-rl's SLURM docs."""

from __future__ import annotations

from pathlib import Path

from prime_core.config.base import ExistingFile, Section


class SlurmConfig(Section):
    """Submit this run to SLURM instead of running it here."""

    job_name: str = "prime"
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    """Wall-clock limit in SLURM's format, e.g. ``24:00:00``."""
    nodelist: str | None = None
    template_path: ExistingFile | None = None
    """A custom Jinja2 sbatch template."""
    pre_run_command: str | None = None
    """Shell run on each node before the roles start (module loads, venv activation)."""
    project_dir: Path | None = None
    """The project on the cluster's shared filesystem; defaults to the current directory."""
