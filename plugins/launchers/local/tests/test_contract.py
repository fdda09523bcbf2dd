"""The local launcher meets the launcher contract (prime_core.testing.contracts.launcher)."""

from prime_core.testing.contracts.launcher import LauncherContract


class TestLocal(LauncherContract):
    name = "local"
    plugin = "prime_plugin_local.plugin"
