"""Every environment meets the environment contract (prime_core.testing.contracts.environment):
the single-turn ones as the one-turn case of an episode, the calculator with its tool, the
guessing game over several turns."""

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


class TestCalculator(EnvironmentContract):
    name = "calculator"
    args: ClassVar = {"digits": 3, "operations": "+*"}
    plugin = "prime_plugin_tasks.plugin"


class TestGuess(EnvironmentContract):
    name = "guess"
    args: ClassVar = {"low": 1, "high": 8, "max_turns": 3}
    plugin = "prime_plugin_tasks.plugin"
    max_turns = 3
