"""The verifiers adapter meets prime's environment contract (prime_core.testing.contracts.environment)
on a taskset written in the tests (conftest.py)."""

from typing import ClassVar

from prime_core.config.env_args import check_env_args
from prime_core.testing.contracts.environment import EnvironmentContract, draw, load_env


class TestReverseTaskset(EnvironmentContract):
    name = "verifiers"
    args: ClassVar = {"taskset": {"id": "prime-vf-reverse", "count": 10, "words": 3}, "answer_field": "answer"}
    plugin = "prime_plugin_verifiers.plugin"

    def test_declared_args(self, spec):
        """The suite's check with the one argument that has no default given: no verifiers
        taskset runs without being named, so ``taskset`` is required; every other argument's
        default is load()'s."""
        assert not check_env_args(spec, self.args, "args")
        named = {"taskset": self.args["taskset"]}
        defaults = spec.args(**named).model_dump()
        assert draw(load_env(spec, named), 0, 8) == draw(load_env(spec, defaults), 0, 8)
