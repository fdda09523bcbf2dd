"""Hooks of prime-plugin-ac: the ``ac`` (``checkpointing`` slot) and ``ac_offloading``
(``activation_offloading`` slot) strategies and their ``trainer.model`` keys."""

from __future__ import annotations

from prime_core import hookimpl
from prime_core.specs import ConfigSection, ParallelStrategy

PRIME_PLUGIN_API = 1


@hookimpl
def prime_config_sections():
    return [ConfigSection(name="trainer.model", model="prime_plugin_ac.config:ACKeys", merge=True, roots=("rl", "sft"))]


@hookimpl
def prime_parallel_strategies():
    return [
        ParallelStrategy(name="ac", slot="checkpointing", apply="prime_plugin_ac.checkpointing:apply",
                         enabled=lambda config, world: config.ac is not None,
                         memory="prime_plugin_ac.memory:checkpointing",
                         description="activation checkpointing: whole blocks (full) or chosen sub-modules (selective)"),
        ParallelStrategy(name="ac_offloading", slot="activation_offloading", apply="prime_plugin_ac.offloading:apply",
                         enabled=lambda config, world: config.ac_offloading is not None,
                         memory="prime_plugin_ac.memory:offloading",
                         description="keep the activations saved for backward in CPU memory"),
    ]
