"""The ac plugin's keys of ``trainer.model``: ``[trainer.model.ac]`` and
``[trainer.model.ac_offloading]`` (prime-rl's names; an empty table turns either on)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from prime_core.config.base import Section, Toggle


class ACConfig(Section):
    """Activation checkpointing."""

    mode: Literal["full", "selective"] = "full"
    freq: int = Field(default=1, ge=1)
    """Checkpoint every ``freq`` blocks (1 = every block)."""
    targets: list[Literal["norm", "attn_proj", "attention", "mlp_proj", "mlp"]] = Field(
        default_factory=lambda: ["norm"], min_length=1)
    """Sub-modules recomputed in ``selective`` mode: ``norm`` (normalisation layers), ``attn_proj``
    (q/k/v/o projections), ``attention``, ``mlp_proj`` (gate/up/down projections), ``mlp``."""
    mlp_token_chunk_size: int | None = Field(default=None, ge=1)
    """Run the dense MLP of each checkpointed block over at most this many tokens at a time,
    each chunk recomputed on its own in the backward pass: its gate, up and product (and their
    gradients) exist for one chunk at a time instead of the whole row, the largest part of a
    block's backward at long sequences. Costs one more MLP forward a block (in ``full`` mode);
    MoE layers are left whole. ``None``: off."""


class ACOffloadingConfig(Section):
    """Offload checkpointed activations to CPU memory."""

    max_inflight_activations: int = Field(default=5, ge=1)
    pin_memory: bool = True
    """Copy into page-locked host memory (asynchronous copies; prime-rl's key). ``false`` saves pinned
    memory at the cost of synchronous copies."""
    blocks: int | None = Field(default=None, ge=1)
    """Offload only the first this-many transformer blocks (in forward order); the later ones keep
    their saved tensors on the GPU. The first blocks' inputs wait longest for the backward pass, so
    their copies back have the most time. Sets how much goes to host memory where all of it would
    not fit there. ``None``: every block."""


class ACKeys(Section):
    ac: Toggle[ACConfig] = None
    """Activation checkpointing of the transformer blocks (``full`` or ``selective``)."""
    ac_offloading: Toggle[ACOffloadingConfig] = None
    """Keep the activations saved for backward in CPU memory."""
