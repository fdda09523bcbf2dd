"""Hooks of prime-plugin-compile: the ``compile`` strategy (``compile`` slot,
``trainer.model.compile``).

Each transformer block (after checkpointing/offloading wrappers, before FSDP) is compiled in
place with ``torch.compile`` (the wrappers pass ``compile`` on to the block inside them); the
blocks share one compiled graph because they have the same code and shapes. Compiling blocks
rather than the whole model keeps graph breaks at the boundaries FSDP hooks into.
``fullgraph = true`` makes any graph break an error.
"""

from __future__ import annotations

from prime_core import hookimpl
from prime_core.specs import ConfigSection, ParallelStrategy

PRIME_PLUGIN_API = 1


RECOMPILE_LIMIT = 32
"""Graphs dynamo keeps for one compiled function before it runs new inputs eagerly (its own
default is 8). Rows of varying length, as every RL step brings, make the token count a symbol,
and Inductor guards its size-dependent choices on ranges of it (its mixed-order reductions at
2,560, 4,096 and 5,120 rows of a 1.7B block, for one): a block needs a graph per range, for
rows of one sample and packed rows alike, and the first, static one. Past 8, an H200 ran the
1.7B step at a third of its speed, every block eager."""


def apply(model, *, config, **_):
    import torch

    from prime_core.trainer.model import transformer_blocks

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    for block in transformer_blocks(model):
        block.compile(fullgraph=config.compile.fullgraph)
    return model


def memory(est, config) -> None:
    """``prime plan``: compiled blocks keep what ``BlockProfile.compiled`` says (Inductor fuses
    element-wise chains and recomputes them in the backward pass)."""
    est.compiled = True


@hookimpl
def prime_trainer_defaults(model_config, context):
    """``compile = "auto"``: on for the native model on a GPU in bf16, where compiled blocks
    were measured exact and faster (1.2x at 8k tokens on an H200), and where no strategy that
    runs collectives or wraps layers inside a block (expert or context parallelism, LoRA) is
    on: those combinations are not verified under compile."""
    if model_config.compile != "auto" or not context.fast or context.impl != "custom":
        return None
    if getattr(model_config, "ep", 1) > 1 or getattr(model_config, "cp", 1) > 1 or getattr(model_config, "lora", None):
        return None
    from prime_core.trainer.defaults import Choice
    from prime_plugin_compile.config import CompileConfig

    return [Choice("compile", CompileConfig(), "the native model's blocks compiled with Inductor on a GPU")]


@hookimpl
def prime_config_sections():
    return [ConfigSection(name="trainer.model", model="prime_plugin_compile.config:CompileKeys", merge=True,
                          roots=("rl", "sft"))]


@hookimpl
def prime_parallel_strategies():
    return [ParallelStrategy(name="compile", slot="compilation", apply=apply,
                             enabled=lambda config, world: config.compile not in (None, "auto"), memory=memory,
                             description="torch.compile of each transformer block")]
