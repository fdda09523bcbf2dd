"""Hooks of prime-plugin-verifiers: ``[[orchestrator.env]] id = "verifiers"`` with
``args = { taskset = { id = "my-taskset", ... } }`` runs an installed verifiers taskset's tasks
and rewards in prime's own rollouts. Nothing heavy is imported here."""

from __future__ import annotations

import importlib.util

from prime_core import hookimpl
from prime_core.specs import Environment

PRIME_PLUGIN_API = 1


def missing() -> str | None:
    if importlib.util.find_spec("verifiers") is None:
        return "the verifiers package is not installed: pip install 'verifiers>=0.4,<0.5'"
    return None


@hookimpl
def prime_environments():
    return [Environment(name="verifiers", load="prime_plugin_verifiers.env:load",
                        args="prime_plugin_verifiers.args:VerifiersArgs", available=missing,
                        description="a verifiers taskset (verifiers.v1): its tasks and rewards, single-turn")]
