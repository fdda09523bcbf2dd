"""The torchrun launcher meets the launcher contract (prime_core.testing.contracts.launcher).
It starts trainers only: ``prime inference`` is refused with a PrimeError, tested in
test_torchrun_plugin.py."""

from prime_core.testing.contracts.launcher import LauncherContract


class TestTorchrun(LauncherContract):
    name = "torchrun"
    plugin = "prime_plugin_torchrun.plugin"
    roots = ("rl", "sft")
