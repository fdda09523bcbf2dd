"""Hooks of prime-plugin-math-env: ``[[orchestrator.env]] id = "math-env"``, as in prime-rl's
SLURM examples (``args = { dataset_name = "PrimeIntellect/Hendrycks-Math", dataset_subset =
"default" }``). Nothing heavy is imported here."""

from __future__ import annotations

import importlib.util

from prime_core import hookimpl
from prime_core.specs import Environment

PRIME_PLUGIN_API = 1


def missing() -> str | None:
    for module, dist in (("datasets", "datasets"), ("math_verify", "math-verify")):
        if importlib.util.find_spec(module) is None:
            return f"the {dist} package is not installed: pip install {dist}"
    return None


@hookimpl
def prime_environments():
    return [Environment(name="math-env", load="prime_plugin_math_env.env:load",
                        args="prime_plugin_math_env.args:MathEnvArgs", available=missing, aliases=("math_env",),
                        description="math problems from a datasets dataset, checked with math-verify")]
