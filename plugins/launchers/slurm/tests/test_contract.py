"""The SLURM launcher's plans meet the launcher contract (prime_core.testing.contracts.launcher);
its launch() submits with sbatch, which test_slurm_cluster.py does against a real cluster."""

from typing import ClassVar

from prime_core.testing.contracts.launcher import LauncherContract


class TestSlurm(LauncherContract):
    name = "slurm"
    plugin = "prime_plugin_slurm.plugin"
    config_args: ClassVar = {root: ["--slurm.job-name", "contract"] for root in ("rl", "sft", "inference")}
    launches_here = False
