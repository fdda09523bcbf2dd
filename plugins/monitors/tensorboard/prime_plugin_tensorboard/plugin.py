"""Hooks of prime-plugin-tensorboard: the ``[tensorboard]`` config table (top level of RL and SFT
configs, copied into the trainer's and the orchestrator's) and the ``tensorboard`` monitor.

Nothing heavy is imported here: the table and the monitor are lazy references, and tensorboard
is imported by the monitor when a role starts it.
"""

from __future__ import annotations

from prime_core import hookimpl
from prime_core.specs import ConfigSection, Monitor

PRIME_PLUGIN_API = 1


@hookimpl
def prime_config_sections():
    return [ConfigSection(name="tensorboard", model="prime_plugin_tensorboard.config:TensorboardConfig",
                          roots=("rl", "sft"), roles=("trainer", "orchestrator"))]


@hookimpl
def prime_monitors():
    return [Monitor(name="tensorboard", make="prime_plugin_tensorboard.monitor:TensorboardMonitor",
                    available="prime_plugin_tensorboard.monitor:missing",
                    description="TensorBoard event files under output_dir/tensorboard, one run per role")]
