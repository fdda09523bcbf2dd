"""Hooks of prime-plugin-cp: the ``cp`` strategy (``context_parallel`` slot;
``trainer.model.cp``, ``cp_style = "ring"`` or ``"ulysses"``) for packed rows split across a
CP group."""

from __future__ import annotations

from prime_core import hookimpl
from prime_core.specs import ConfigSection, ParallelStrategy

PRIME_PLUGIN_API = 1


@hookimpl
def prime_config_sections():
    return [ConfigSection(name="trainer.model", model="prime_plugin_cp.config:CPKeys", merge=True, roots=("rl", "sft"))]


@hookimpl
def prime_parallel_strategies():
    return [ParallelStrategy(
        name="cp", slot="context_parallel", apply="prime_plugin_cp.strategy:apply",
        enabled=lambda config, world: config.cp > 1, mesh_dims=("cp",), degrees=lambda config: {"cp": config.cp},
        splits_rows=True, memory="prime_plugin_cp.memory:memory",
        description="context parallelism for packed rows: ring (KV passes around the CP group) or ulysses "
                    "(all-to-all heads)",
    )]
