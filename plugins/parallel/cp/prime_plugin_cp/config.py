"""The cp plugin's keys of ``trainer.model`` (prime-rl's names)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from prime_core.config.base import Section


class CPKeys(Section):
    cp: int = Field(default=1, ge=1)
    """Context-parallel degree: each packed row is split over this many consecutive trainer processes."""
    cp_style: Literal["ring", "ulysses"] = "ring"
    """``ring``: keys and values travel around the CP group; ``ulysses``: all-to-all of heads."""
    cp_ring_kernel: Literal["auto", "cudnn", "flash", "eager"] = "auto"
    """The ring's per-block kernel: ``flash`` (torch's flash-attention varlen kernel: CUDA,
    bf16/fp16), ``cudnn`` (cuDNN's fused attention for the parts one call of it can run, flash
    for the others), ``eager`` (the float32 reference, any device), ``auto`` (cudnn on Hopper
    and newer, else flash, where they run; else eager)."""

    @model_validator(mode="after")
    def _cp_needs_native_model(self):
        if self.cp > 1 and getattr(self, "impl", None) == "hf":
            raise ValueError(f"cp = {self.cp} needs impl = 'custom' (or 'auto' for a supported family): the "
                             "Hugging Face implementation has no context parallel layers")
        return self
