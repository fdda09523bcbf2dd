"""Hooks of prime-plugin-math-env: ``[[orchestrator.env]] id = "math-env"``, as in prime-rl's
SLURM examples (``args = { dataset_name = "PrimeIntellect/Hendrycks-Math", dataset_subset =
"default" }``). Nothing heavy is imported here.

- ``prime_environments``: the environment;
- ``prime_validate_config``: a dataset offline roles would not find in this machine's cache,
  named before anything starts (``--dry-run`` says so too), not when the orchestrator loads it."""

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


@hookimpl
def prime_validate_config(config, root, here):
    if not here or missing() is not None:
        return []
    from pydantic import ValidationError

    from prime_core.config.env_args import configured_envs
    from prime_core.hf_data import cache_problem
    from prime_plugin_math_env.args import MathEnvArgs

    problems = []
    for where, env in configured_envs(config, root):
        if env.id not in ("math-env", "math_env"):
            continue
        try:
            args = MathEnvArgs(**env.args)
        except ValidationError:
            continue  # the arguments' own check names what is wrong
        problem = cache_problem(args.dataset_name, args.dataset_subset, args.dataset_split, who="math-env",
                                key="dataset_name")
        if problem:
            problems.append(f"{where}.args: {problem}")
    return problems
