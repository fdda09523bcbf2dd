"""The vllm plugin's keys of the ``inference`` config (prime-rl's names)."""

from __future__ import annotations

from prime_core.config.base import Section


class VLLMModelKeys(Section):
    enforce_eager: bool = False
    """Run the model eagerly (no CUDA graphs or compilation): a faster start, slower steps."""
