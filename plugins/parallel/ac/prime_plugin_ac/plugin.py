"""Hooks of prime-plugin-ac: the ``ac`` and ``ac_offloading`` parallel strategies."""

from __future__ import annotations

from prime_core import hookimpl
from prime_core.specs import ParallelStrategy

PRIME_PLUGIN_API = 1


def _ac(model, **kwargs):
    from prime_plugin_ac.checkpointing import apply

    return apply(model, **kwargs)


def _offload(model, **kwargs):
    from prime_plugin_ac.offloading import apply

    return apply(model, **kwargs)


@hookimpl
def prime_parallel_strategies():
    return [
        ParallelStrategy(name="ac", apply=_ac,
                         description="activation checkpointing: whole blocks (full) or chosen sub-modules (selective)"),
        ParallelStrategy(name="ac_offloading", apply=_offload,
                         description="keep the activations saved for backward in CPU memory"),
    ]
