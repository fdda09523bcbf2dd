"""reasoning-gym datasets meet prime's environment contract (prime_core.testing.contracts.environment):
a plain one with settings passed through, a composite of two, and one whose items have no single
reference answer."""

from typing import ClassVar

from prime_core.testing.contracts.environment import EnvironmentContract

PLUGIN = "prime_plugin_reasoning_gym.plugin"


class TestCountdown(EnvironmentContract):
    name = "reasoning-gym"
    args: ClassVar = {"dataset": "countdown", "min_numbers": 3, "max_numbers": 4, "size": 200}
    plugin = PLUGIN


class TestComposite(EnvironmentContract):
    name = "reasoning-gym"
    args: ClassVar = {"dataset": "composite", "seed": 7, "datasets": [
        {"name": "basic_arithmetic", "weight": 1.0, "config": {}},
        {"name": "spell_backward", "weight": 2.0, "config": {"min_word_len": 4}}]}
    plugin = PLUGIN


class TestPropositionalLogic(EnvironmentContract):
    name = "reasoning-gym"
    args: ClassVar = {"dataset": "propositional_logic", "system_prompt": "direct"}
    plugin = PLUGIN
