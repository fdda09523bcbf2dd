"""The arguments each environment's ``load`` takes, declared for ``prime config validate``
(``Environment.args``): ``[[orchestrator.env]] args`` are checked against these models
before a run starts. The defaults are the environments' own."""

from __future__ import annotations

import string

from pydantic import Field, model_validator

from prime_core.config.base import Section


class ReverseTextArgs(Section):
    min_len: int = Field(default=3, ge=1)
    """Shortest string to reverse."""
    max_len: int = Field(default=6, ge=1)
    """Longest string to reverse."""
    alphabet: str = Field(default=string.ascii_lowercase, min_length=1)
    """Characters the strings are drawn from."""

    @model_validator(mode="after")
    def _ordered(self):
        if self.min_len > self.max_len:
            raise ValueError(f"min_len ({self.min_len}) must not exceed max_len ({self.max_len})")
        return self


class ArithmeticArgs(Section):
    digits: int = Field(default=1, ge=1)
    """Digits per operand."""
    operands: int = Field(default=2, ge=2)
    """Numbers to add."""


class CalculatorArgs(Section):
    digits: int = Field(default=3, ge=1, le=9)
    """Digits per operand."""
    operations: str = Field(default="+", pattern=r"^[+\-*]+$")
    """Operators to draw from, e.g. ``"+-*"``."""


class GuessArgs(Section):
    low: int = 1
    """Smallest secret number."""
    high: int = 16
    """Largest secret number."""
    max_turns: int = Field(default=6, ge=1)
    """Guesses allowed (the reward falls by 1/max_turns per extra guess)."""

    @model_validator(mode="after")
    def _ordered(self):
        if self.low >= self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        return self
