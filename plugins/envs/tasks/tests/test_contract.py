"""Both environments meet the environment contract (prime_core.testing.contracts.environment)."""

from typing import ClassVar

from prime_core.testing.contracts.environment import EnvironmentContract


class TestReverseText(EnvironmentContract):
    name = "reverse_text"
    args: ClassVar = {"min_len": 2, "max_len": 5}
    plugin = "prime_plugin_tasks.plugin"


class TestArithmetic(EnvironmentContract):
    name = "arithmetic"
    args: ClassVar = {"digits": 2, "operands": 3}
    plugin = "prime_plugin_tasks.plugin"
