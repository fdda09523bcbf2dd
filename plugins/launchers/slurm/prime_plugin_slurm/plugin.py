"""Hooks of prime-plugin-slurm.

Registers the ``[slurm]`` config table so that configs written for SLURM load and validate.
Submitting them (the ``slurm`` launcher) is not implemented in this version: a run whose
config has a ``[slurm]`` table is refused with that reason instead of silently running here.
"""

from __future__ import annotations

from prime_core import hookimpl
from prime_core.specs import ConfigSection

PRIME_PLUGIN_API = 1


@hookimpl
def prime_config_sections():
    from prime_plugin_slurm.config import SlurmConfig

    return [ConfigSection(name="slurm", model=SlurmConfig, roots=("rl", "sft", "inference"),
                          description="Submit the run to SLURM (sbatch).")]


@hookimpl
def prime_validate_config(config, root):
    if getattr(config, "slurm", None) is not None:
        yield ("slurm: this version of prime-plugin-slurm reads the [slurm] table but cannot submit "
               "jobs yet; remove [slurm] to run on this machine")
