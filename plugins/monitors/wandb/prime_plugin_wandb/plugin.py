"""Hooks of prime-plugin-wandb: the ``[wandb]`` config table (top level of RL and SFT configs,
copied into the trainer's and the orchestrator's) and the ``wandb`` monitor.

Nothing heavy is imported here: the table and the monitor are lazy references, and wandb is
imported by the monitor when a role starts it.
"""

from __future__ import annotations

from prime_core import hookimpl
from prime_core.specs import ConfigSection, Monitor

PRIME_PLUGIN_API = 1


@hookimpl
def prime_config_sections():
    return [ConfigSection(name="wandb", model="prime_plugin_wandb.config:WandbConfig", roots=("rl", "sft"),
                          roles=("trainer", "orchestrator"))]


@hookimpl
def prime_monitors():
    return [Monitor(name="wandb", make="prime_plugin_wandb.monitor:WandbMonitor",
                    available="prime_plugin_wandb.monitor:missing",
                    description="Weights & Biases: one run per RL run (offline without an API key or network)")]


@hookimpl
def prime_validate_config(config, root):
    """The trainer and the orchestrator share one W&B run: they must agree on where it is."""
    if root != "rl":
        return
    trainer, orchestrator = getattr(config.trainer, "wandb", None), getattr(config.orchestrator, "wandb", None)
    if trainer is None or orchestrator is None:
        return
    if trainer.shared != orchestrator.shared:
        yield ("trainer.wandb.shared / orchestrator.wandb.shared: the roles disagree on sharing one W&B run; "
               "set shared once in the top-level [wandb] table")
        return
    if not trainer.shared:
        return
    for key in ("project", "entity", "id", "dir"):
        ours, theirs = getattr(trainer, key), getattr(orchestrator, key)
        if ours != theirs:
            yield (f"trainer.wandb.{key} / orchestrator.wandb.{key}: {ours!r} != {theirs!r}, but both roles log "
                   f"into one W&B run; set {key} in the top-level [wandb] table (or shared = false for a run per role)")
