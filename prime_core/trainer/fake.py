"""Fake training data for benchmarks and tests: random tokens, fixed or variable length."""

from __future__ import annotations

import random
from typing import Annotated, Literal

from pydantic import Field

from prime_core.config.base import Noted, Section


class FakeDataConfig(Section):
    """``trainer.data.fake``: random batches instead of the orchestrator's (for ``--bench``)."""

    batch_size: int = Field(default=4, ge=1)
    """Samples per step."""
    length: Literal["fixed", "variable"] = "fixed"
    """``fixed``: every sample is ``seq_len`` tokens; ``variable``: 8 to ``seq_len``, packed."""
    seed: int = 0

    # prime-rl's fake-data keys for its own loader.
    input_ids: Annotated[Literal["increasing", "random"], Noted("prime's fake tokens are random ids")] = "random"
    micro_batch_size: Annotated[int | None, Noted(
        "prime packs samples into seq_len-long micro-batches itself")] = None
    pack_function: Annotated[Literal["cat", "stack"], Noted("prime packs by concatenation (cat)")] = "cat"
    generate_samples: Annotated[bool | None, Noted("prime generates fake samples as length says")] = None


def fake_samples(count: int, seq_len: int, vocab_size: int, length: str, rng: random.Random) -> list:
    """Samples with a one-token prompt and random advantages (zero sampling log-probs)."""
    from prime_core.orchestrator.batch import TrainingSample

    out = []
    for _ in range(count):
        n = seq_len if length == "fixed" else rng.randint(min(8, seq_len), seq_len)
        ids = [rng.randrange(vocab_size) for _ in range(n)]
        out.append(TrainingSample(ids[:1], ids[1:], [0.0] * (n - 1), rng.uniform(-1, 1), 0.0, 0))
    return out


def fake_batch(config: FakeDataConfig, seq_len: int, vocab_size: int, rng: random.Random) -> dict:
    """One step as the trainer reads it from a step file: the orchestrator's packed rows, each
    field a numpy array (``batch_format.row_arrays``; a list would cost the timed step its
    conversion, about 1 ms a row of 8k tokens)."""
    from prime_core.orchestrator.batch import pack
    from prime_core.orchestrator.batch_format import row_arrays

    samples = fake_samples(config.batch_size, seq_len, vocab_size, config.length, rng)
    return {"micro_batches": [row_arrays(row.as_dict()) for row in pack(samples, seq_len)], "temperature": 1.0,
            "info": {"reward": 0.0}}
