"""Activation checkpointing (``trainer.model.ac``).

``full``: every ``freq``-th transformer block keeps only its input and recomputes the rest in
the backward pass. ``selective``: in those blocks only the sub-modules named by ``targets``
are recomputed, a smaller saving for a smaller recompute cost:

- ``norm``: the normalisation layers (cheap to recompute, each saves a full activation);
- ``attn_proj``: the query/key/value/output projections;
- ``attention``: the whole attention sub-block;
- ``mlp_proj``: the MLP's gate/up/down projections;
- ``mlp``: the whole MLP sub-block.

``mlp_token_chunk_size``: in those blocks each dense MLP runs over chunks of at most that many
tokens, each chunk under its own checkpoint (``TokenChunkedMLP``). A token's MLP output depends
on that token alone, so the chunks compute the same numbers; in the backward pass autograd
finishes one chunk (its recomputation, then its gradients) before it starts the next, so the
MLP's intermediates (three of ``intermediate_size`` per token, and their gradients) exist for
one chunk at a time. The weights' gradients are summed over the chunks, as over micro-batches.
"""

from __future__ import annotations

import functools

TARGETS = {
    "norm": lambda name, module: type(module).__name__.endswith(("Norm", "RMSNorm", "LayerNorm")),
    "attn_proj": lambda name, module: name.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj"),
    "attention": lambda name, module: name.rsplit(".", 1)[-1] in ("self_attn", "attn", "attention"),
    "mlp_proj": lambda name, module: name.rsplit(".", 1)[-1] in ("gate_proj", "up_proj", "down_proj", "gate_up_proj"),
    "mlp": lambda name, module: name.rsplit(".", 1)[-1] in ("mlp", "feed_forward"),
}


def wrap(module):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    wrapper = checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=False)
    # torch.compile of the wrapper traces the checkpoint as one higher-order op, and only when the
    # whole block traces without a graph break; at one break (the varlen attention of a packed
    # row and the MLP's token chunks stay out of graphs by design) dynamo runs the whole block
    # eagerly, its forward and its recomputation. Compiled inside the checkpoint, a break splits
    # the block's graph in two (the compile strategy calls ``compile`` on each block it finds;
    # selective mode's wrappers sit inside a block and are traced with it).
    wrapper.compile = module.compile
    return wrapper


def apply(model, *, config, **_):
    from prime_core.errors import ConfigError
    from prime_core.trainer.model import transformer_blocks

    ac = config.ac
    blocks = transformer_blocks(model)
    chunked = 0
    for index, block in enumerate(blocks):
        if index % ac.freq:
            continue
        targets = ac.targets
        has_chunks = bool(ac.mlp_token_chunk_size) and chunk_mlps(block, ac.mlp_token_chunk_size) > 0
        if has_chunks:
            chunked += 1
            # The chunks are recomputed already: checkpointing the MLP again would recompute it twice.
            targets = [t for t in targets if t not in ("mlp", "mlp_proj")]
        if ac.mode == "full":
            blocks[index] = wrap(block)
        elif targets:
            wrap_selected(block, targets)
    if ac.mlp_token_chunk_size and not chunked:
        raise ConfigError([f"trainer.model.ac.mlp_token_chunk_size = {ac.mlp_token_chunk_size}: no checkpointed "
                           f"block of {type(model).__name__} has a dense MLP (a sub-module named mlp or "
                           "feed_forward, without experts) to run in chunks; remove the key"])
    return model


def chunkable(module) -> bool:
    """A dense MLP: a token's output depends on that token alone and nothing inside talks to
    other ranks (an MoE layer under expert parallelism exchanges tokens, and ranks would run
    different numbers of chunks)."""
    return not hasattr(module, "experts")


def chunk_mlps(block, size: int) -> int:
    """Replace each dense MLP of ``block`` by a ``TokenChunkedMLP`` of ``size`` tokens; how many."""
    names = [name for name, module in block.named_modules()
             if name and TARGETS["mlp"](name, module) and chunkable(module)]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = block.get_submodule(parent_name) if parent_name else block
        setattr(parent, child, token_chunked_class()(getattr(parent, child), size))
    return len(names)


@functools.cache
def token_chunked_class():
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

    class TokenChunkedMLP(ActivationWrapper):
        """Runs the wrapped MLP over ``size`` tokens at a time, each chunk checkpointed. A
        checkpoint wrapper as torch's are: parameter and state-dict names leave it out."""

        def __init__(self, mlp, size: int) -> None:
            super().__init__(mlp)
            self.size = size

        # Outside a compiled block's graph: the number of chunks follows the row's length.
        @torch._dynamo.disable
        def forward(self, x):
            from torch.utils.checkpoint import checkpoint

            flat = x.reshape(-1, x.shape[-1])
            pieces = [checkpoint(self._checkpoint_wrapped_module, piece, use_reentrant=False,
                                 preserve_rng_state=False) for piece in flat.split(self.size)]
            out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
            return out.view(*x.shape[:-1], out.shape[-1])

    return TokenChunkedMLP


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
