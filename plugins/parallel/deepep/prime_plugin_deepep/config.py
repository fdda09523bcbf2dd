"""The deepep plugin's keys of ``trainer.model`` (prime-rl's names)."""

from __future__ import annotations

from pydantic import Field

from prime_core.config.base import Section


class DeepEPKeys(Section):
    deepep_num_sms: int | None = Field(default=None, ge=1)
    """SMs DeepEP's kernels may use (even); DeepEP's default when unset."""
    deepep_token_chunk_size: int | None = Field(default=None, ge=1)
    """Tokens dispatched per DeepEP call; all of a rank's tokens at once when unset."""
