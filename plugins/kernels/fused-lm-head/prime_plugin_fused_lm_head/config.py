"""The fused-lm-head plugin's key of ``trainer.model`` (prime-rl's name), and the rule that
SFT takes no fixed chunk size."""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from prime_core.config.base import Section


class FusedLMHeadKeys(Section):
    fused_lm_head_token_chunk_size: int | Literal["auto", "disabled"] | None = None
    """Compute log-probabilities from the hidden states this many tokens at a time, without
    the ``[tokens, vocab]`` logits (``auto``: sized from the shapes; ``disabled``: the vanilla
    head). Unset: ``auto`` for RL with the native model on a GPU in bf16, ``disabled``
    otherwise (decided when the trainer starts). Needs a native model (``impl = "custom"``);
    the implementation is ``trainer.model.kernels.lm_head`` (``fused`` by default)."""


class SFTChunk(Section):
    @model_validator(mode="after")
    def _rl_only(self):
        chunk = self.model.fused_lm_head_token_chunk_size
        if isinstance(chunk, int):
            raise ValueError(f"model.fused_lm_head_token_chunk_size = {chunk}: the chunked LM head is RL-only; SFT "
                             "accepts 'auto' or 'disabled'")
        return self
