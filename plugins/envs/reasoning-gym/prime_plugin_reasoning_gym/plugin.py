"""Hooks of prime-plugin-reasoning-gym: ``[[orchestrator.env]] id = "reasoning-gym"`` with
``args = { dataset = "countdown", ... }`` (any dataset of the ``reasoning-gym`` package; its
settings pass through). Nothing heavy is imported here."""

from __future__ import annotations

import importlib.util

from prime_core import hookimpl
from prime_core.specs import Environment

PRIME_PLUGIN_API = 1


def missing() -> str | None:
    if importlib.util.find_spec("reasoning_gym") is None:
        return "the reasoning-gym package is not installed: pip install reasoning-gym"
    return None


@hookimpl
def prime_environments():
    return [Environment(name="reasoning-gym", load="prime_plugin_reasoning_gym.env:load",
                        args="prime_plugin_reasoning_gym.args:ReasoningGymArgs", available=missing,
                        aliases=("reasoning_gym",),
                        description="any reasoning-gym dataset (procedural), scored by reasoning-gym")]
