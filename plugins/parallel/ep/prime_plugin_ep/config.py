"""The ep plugin's keys of ``trainer.model`` (prime-rl's names)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from prime_core.config.base import Section, Selects


class EPKeys(Section):
    ep: int = Field(default=1, ge=1)
    """Expert-parallel degree: the experts of every MoE layer are split over this many
    consecutive trainer processes; must divide the number of experts and of processes."""
    ep_comm_backend: Annotated[str, Selects("ep_backends", when=lambda m: m.ep > 1)] = "torch"
    """How tokens reach their experts: an EP backend from a plugin (``prime plugins list``)."""

    @model_validator(mode="after")
    def _ep_needs_native_model(self):
        if self.ep > 1 and getattr(self, "impl", None) == "hf":
            raise ValueError(f"ep = {self.ep} needs impl = 'custom' (or 'auto' for a supported family): the "
                             "Hugging Face implementation has no expert parallel layers")
        return self
