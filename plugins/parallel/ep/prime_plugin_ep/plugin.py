"""Hooks of prime-plugin-ep: the ``ep`` parallel strategy, the ``torch`` EP backend, and the
config checks of ``trainer.model.ep``.

Importing this module stays cheap: torch is imported by the functions that need it.
"""

from __future__ import annotations

from prime_core import hookimpl
from prime_core.specs import EPBackend, ParallelStrategy

PRIME_PLUGIN_API = 1


def _apply(model, **kwargs):
    from prime_plugin_ep.strategy import apply

    return apply(model, **kwargs)


def _make_torch(group, *, num_experts, config=None):
    from prime_plugin_ep.dispatch import make

    return make(group, num_experts=num_experts, config=config)


@hookimpl
def prime_parallel_strategies():
    return [ParallelStrategy(
        name="ep", apply=_apply, mesh_dims=("dp_mod_ep", "ep"),
        description="expert parallelism: experts sharded over trainer.model.ep ranks, tokens dispatched to them",
    )]


@hookimpl
def prime_ep_backends():
    return [EPBackend(name="torch", make=_make_torch,
                      description="all-to-all dispatch/combine with torch.distributed (NCCL or gloo)")]


@hookimpl
def prime_validate_config(config, root):
    from prime_plugin_ep.validate import problems

    return problems(config, root)
