"""Activation checkpointing (``trainer.model.ac``).

``full``: every ``freq``-th transformer block keeps only its input and recomputes the rest in
the backward pass. ``selective``: in those blocks only the sub-modules named by ``targets``
are recomputed, a smaller saving for a smaller recompute cost:

- ``norm``: the normalisation layers (cheap to recompute, each saves a full activation);
- ``attn_proj``: the query/key/value/output projections;
- ``attention``: the whole attention sub-block;
- ``mlp_proj``: the MLP's gate/up/down projections;
- ``mlp``: the whole MLP sub-block.
"""

from __future__ import annotations

TARGETS = {
    "norm": lambda name, module: type(module).__name__.endswith(("Norm", "RMSNorm", "LayerNorm")),
    "attn_proj": lambda name, module: name.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj"),
    "attention": lambda name, module: name.rsplit(".", 1)[-1] in ("self_attn", "attn", "attention"),
    "mlp_proj": lambda name, module: name.rsplit(".", 1)[-1] in ("gate_proj", "up_proj", "down_proj", "gate_up_proj"),
    "mlp": lambda name, module: name.rsplit(".", 1)[-1] in ("mlp", "feed_forward"),
}


def wrap(module):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=False)


def apply(model, *, config, **_):
    from prime_core.trainer.model import transformer_blocks

    ac = config.ac
    blocks = transformer_blocks(model)
    for index, block in enumerate(blocks):
        if index % ac.freq:
            continue
        if ac.mode == "full":
            blocks[index] = wrap(block)
        else:
            wrap_selected(block, ac.targets)
    return model


def wrap_selected(block, targets: list[str]) -> int:
    """Wrap the outermost sub-modules of ``block`` that match a target; returns how many."""
    chosen = [name for name, module in block.named_modules()
              if name and any(TARGETS[t](name, module) for t in targets)]
    chosen = [n for n in chosen if not any(n.startswith(other + ".") for other in chosen)]
    for name in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = block.get_submodule(parent_name) if parent_name else block
        setattr(parent, child, wrap(getattr(parent, child)))
    if not chosen:
        raise ValueError(f"trainer.model.ac.targets = {targets}: nothing in {type(block).__name__} matches")
    return len(chosen)
