"""Hooks of prime-plugin-ep: the ``ep`` strategy (``expert_parallel`` slot), the ``torch`` EP
backend, the ``trainer.model.ep`` / ``ep_comm_backend`` keys and their config checks.

Importing this module stays cheap: torch is imported by the functions that need it.
"""

from __future__ import annotations

from prime_core import hookimpl
from prime_core.specs import ConfigSection, EPBackend, ParallelStrategy

PRIME_PLUGIN_API = 1


@hookimpl
def prime_config_sections():
    return [ConfigSection(name="trainer.model", model="prime_plugin_ep.config:EPKeys", merge=True, roots=("rl", "sft"))]


@hookimpl
def prime_parallel_strategies():
    return [ParallelStrategy(
        name="ep", slot="expert_parallel", apply="prime_plugin_ep.strategy:apply",
        enabled=lambda config, world: config.ep > 1, mesh_dims=("dp_mod_ep", "ep"),
        degrees=lambda config: {"ep": config.ep}, memory="prime_plugin_ep.memory:memory",
        description="expert parallelism: experts sharded over trainer.model.ep ranks, tokens dispatched to them",
    )]


@hookimpl
def prime_ep_backends():
    return [EPBackend(name="torch", make="prime_plugin_ep.dispatch:make",
                      description="all-to-all dispatch/combine with torch.distributed (NCCL or gloo)")]


@hookimpl
def prime_validate_config(config, root):
    from prime_plugin_ep.validate import problems

    return problems(config, root)
