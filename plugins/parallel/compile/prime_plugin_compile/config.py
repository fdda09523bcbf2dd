"""The compile plugin's key of ``trainer.model``: ``[trainer.model.compile]``."""

from __future__ import annotations

from prime_core.config.base import Section, Toggle


class CompileConfig(Section):
    """``torch.compile`` of the transformer blocks."""

    fullgraph: bool = False
    """Make any graph break an error."""


class CompileKeys(Section):
    compile: Toggle[CompileConfig] = None
    """Compile every transformer block with ``torch.compile`` (an empty table turns it on)."""
