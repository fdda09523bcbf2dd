"""Hooks of prime-plugin-tasks: procedurally generated RL environments (no downloads).

- ``reverse_text`` (args ``min_len``, ``max_len``, ``alphabet``): reverse a random string;
  reward is the similarity to the exact reversal.
- ``arithmetic`` (args ``digits``, ``operands``): add integers; reward 1 for the exact sum.
"""

from __future__ import annotations

from prime_core import hookimpl
from prime_core.specs import Environment

PRIME_PLUGIN_API = 1


def _reverse_text(**args):
    from prime_plugin_tasks.reverse_text import ReverseText

    return ReverseText(**args)


def _arithmetic(**args):
    from prime_plugin_tasks.arithmetic import Arithmetic

    return Arithmetic(**args)


@hookimpl
def prime_environments():
    return [
        Environment(name="reverse_text", load=_reverse_text, description="reverse a random string"),
        Environment(name="arithmetic", load=_arithmetic, description="add random integers"),
    ]
