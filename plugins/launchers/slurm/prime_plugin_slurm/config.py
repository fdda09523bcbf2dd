"""The ``[slurm]`` table, with the keys of prime-rl's SLURM docs.

Where the roles run (nodes, GPUs per node) is the ``[deployment]`` block's business; this
table says how the job is written and submitted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, model_validator

from prime_core.config.base import ExistingFile, Noted, Section


class SlurmConfig(Section):
    """Submit this run to SLURM (an sbatch script from a Jinja2 template) instead of running it here."""

    job_name: str = "prime"
    """The SLURM job name (``#SBATCH --job-name``); also names the tmux session of the log helper."""
    partition: str | None = None
    """``#SBATCH --partition``; the cluster's default partition when unset."""
    account: str | None = None
    """``#SBATCH --account``."""
    time: str | None = None
    """Wall-clock limit in SLURM's format, e.g. ``24:00:00`` (``#SBATCH --time``)."""
    nodelist: str | None = None
    """Run on these nodes (``#SBATCH --nodelist``, e.g. ``node[01-04]``)."""
    template_path: ExistingFile | None = None
    """A custom Jinja2 sbatch template (see the plugin's README for its variables)."""
    pre_run_command: str | None = None
    """Shell run at the start of the job, before any role (module loads, venv activation, exports)."""
    project_dir: Path | None = None
    """The project on the cluster's shared filesystem: the job runs there. Defaults to the
    directory you submit from."""
    python: str | None = None
    """The Python that runs prime inside the job; defaults to the one submitting it (a shared
    virtual environment), or set ``"python"`` when ``pre_run_command`` activates one."""
    hf_hub_offline: bool = True
    """Export ``HF_HUB_OFFLINE=1`` in the job (models come from local folders or the cache)."""
    exclusive: bool = True
    """``#SBATCH --exclusive``: the job gets whole nodes (all their CPUs and memory)."""
    request_gpus: bool = True
    """Request the deployment's GPUs (``#SBATCH --gpus-per-node=N``); false on CPU-only partitions."""
    rdzv_port: int = Field(default=29500, ge=1, le=65535)
    """Port of the trainer's torchrun rendezvous on the first train node (multi-node)."""
    sbatch_options: dict[str, str | int | bool] = Field(default_factory=dict)
    """Further ``#SBATCH`` options, e.g. ``{qos = "high", mem = "0"}`` → ``--qos=high``,
    ``--mem=0`` (``true`` writes the bare flag)."""
    exclude: str | None = None
    """Nodes the job must not run on (``#SBATCH --exclude``, e.g. ``node[05-06]``)."""
    cleanup_grace_period: Annotated[int | None, Noted(
        "a failing role stops the whole job at once in prime (its checkpoints are written atomically)")] = None

    @model_validator(mode="after")
    def _exclude_option(self) -> SlurmConfig:
        if self.exclude is not None:
            self.sbatch_options = {"exclude": self.exclude, **self.sbatch_options}
        return self


LEGACY_KEYS = ("job_name", "project_dir", "template_path", "partition", "account", "time")
"""Keys prime-rl's older ``rl_slurm`` docs set at the top level of the config."""


class LegacyTopLevelKeys(Section):
    """The older docs' top-level ``job_name = ...`` etc. land in ``[slurm]`` (which wins)."""

    @model_validator(mode="before")
    @classmethod
    def _into_slurm(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not any(k in data for k in LEGACY_KEYS):
            return data
        data = dict(data)
        legacy = {k: data.pop(k) for k in LEGACY_KEYS if k in data}
        slurm = data.get("slurm") if isinstance(data.get("slurm"), dict) else {}
        data["slurm"] = {**legacy, **slurm}
        return data
