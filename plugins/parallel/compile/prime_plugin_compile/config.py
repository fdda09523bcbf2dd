"""The compile plugin's key of ``trainer.model``: ``[trainer.model.compile]``."""

from __future__ import annotations

from typing import Literal

from prime_core.config.base import Section, Toggle


class CompileConfig(Section):
    """``torch.compile`` of the transformer blocks."""

    fullgraph: bool = False
    """Make any graph break an error. The attention kernels run a packed row (several samples)
    outside the block's graph, so with it only rows of one sample can be compiled."""


class CompileKeys(Section):
    compile: Literal["auto"] | Toggle[CompileConfig] = "auto"
    """Compile every transformer block with ``torch.compile`` (an empty table turns it on,
    ``false`` off). ``auto``: on where it is verified, the native model on a GPU in bf16
    without expert or context parallelism or LoRA; off elsewhere."""
