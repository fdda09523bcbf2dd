"""Hooks of prime-plugin-cp: the ``cp`` parallel strategy (``trainer.model.cp``,
``cp_style = "ring"`` or ``"ulysses"``) for packed rows split across a CP group."""

from __future__ import annotations

from prime_core import hookimpl
from prime_core.specs import ParallelStrategy

PRIME_PLUGIN_API = 1


def _apply(model, **kwargs):
    from prime_plugin_cp.strategy import apply

    return apply(model, **kwargs)


@hookimpl
def prime_parallel_strategies():
    return [ParallelStrategy(
        name="cp", apply=_apply, mesh_dims=("cp",),
        description="context parallelism for packed rows: ring (KV passes around the CP group) or ulysses "
                    "(all-to-all heads)",
    )]
