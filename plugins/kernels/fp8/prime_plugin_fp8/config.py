"""The fp8 plugin's key of ``trainer.model`` (prime-rl's name)."""

from __future__ import annotations

from typing import Literal

from prime_core.config.base import Section


class FP8Keys(Section):
    quantization: Literal["fp8"] | None = None
    """``fp8``: the transformer blocks' linear layers compute in block-scaled FP8 (after LoRA,
    before every strategy that wraps or shards); the backend is ``trainer.model.kernels.fp8_linear``
    (``auto`` by default)."""
