"""Hooks of prime-plugin-compile: the ``compile`` strategy (``compile`` slot,
``trainer.model.compile``).

Each transformer block (after checkpointing/offloading wrappers, before FSDP) is compiled in
place with ``torch.compile``; the blocks share one compiled graph because they have the same
code and shapes. Compiling blocks rather than the whole model keeps graph breaks at the
boundaries FSDP hooks into. ``fullgraph = true`` makes any graph break an error.
"""

from __future__ import annotations

from prime_core import hookimpl
from prime_core.specs import ConfigSection, ParallelStrategy

PRIME_PLUGIN_API = 1


def apply(model, *, config, **_):
    from prime_core.trainer.model import transformer_blocks

    for block in transformer_blocks(model):
        block.compile(fullgraph=config.compile.fullgraph)
    return model


def memory(est, config) -> None:
    """``prime plan``: compiled blocks keep what ``BlockProfile.compiled`` says (Inductor fuses
    element-wise chains and recomputes them in the backward pass)."""
    est.compiled = True


@hookimpl
def prime_config_sections():
    return [ConfigSection(name="trainer.model", model="prime_plugin_compile.config:CompileKeys", merge=True,
                          roots=("rl", "sft"))]


@hookimpl
def prime_parallel_strategies():
    return [ParallelStrategy(name="compile", slot="compilation", apply=apply,
                             enabled=lambda config, world: config.compile is not None, memory=memory,
                             description="torch.compile of each transformer block")]
