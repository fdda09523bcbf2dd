"""The sampling contract between the orchestrator and an inference backend's client.

The orchestrator speaks only these types; how they travel (HTTP bodies, endpoints, model
names, adapters) is the backend's business (``InferenceBackend.client`` in
``prime_core.specs`` documents the calls). Token ids go in and token ids come out, each with
the log-probability it was sampled with, so that nothing is ever re-tokenized: a later
multi-turn trajectory appends the sampled ids to its prompt as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True, kw_only=True)
class SampleRequest:
    """``n`` independent continuations of one prompt.

    ``session_id`` names the trajectory (or group) the request belongs to: a router may keep
    the requests of one session on one replica (its prefix cache), and a backend may forward
    it to a router in front of its servers. It changes nothing about the samples.
    """

    prompt_ids: list[int]
    """The prompt as token ids (chat template already applied)."""
    max_tokens: int
    """Most tokens per sample."""
    n: int = 1
    temperature: float = 1.0
    """0 samples greedily."""
    top_p: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    """Stop after sampling one of these (it is the last token returned); the model's end of
    sequence token always stops."""
    seed: int | None = None
    """Makes sampling reproducible on one server, where the backend supports it."""
    session_id: str | None = None

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("SampleRequest.prompt_ids is empty: a prompt needs at least one token")
        if self.n < 1 or self.max_tokens < 1:
            raise ValueError(f"SampleRequest needs n >= 1 and max_tokens >= 1 (got n={self.n}, "
                             f"max_tokens={self.max_tokens})")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"SampleRequest needs temperature >= 0 and 0 < top_p <= 1 (got "
                             f"temperature={self.temperature}, top_p={self.top_p})")


@dataclass(frozen=True)
class Sample:
    """One sampled continuation, exactly as the server produced it."""

    token_ids: list[int]
    """The sampled tokens (the prompt excluded), including a final stop token if one was sampled."""
    logprobs: list[float]
    """``logprobs[i]``: log-probability of ``token_ids[i]`` under the distribution it was
    sampled from (temperature applied), one per token."""
    finish_reason: str
    """``"stop"`` (end of sequence or a stop token) or ``"length"`` (``max_tokens`` reached);
    a backend may report others (``"abort"``)."""
    text: str
    """``token_ids`` decoded, for scoring; never tokenized again for training."""

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"Sample has {len(self.token_ids)} token ids but {len(self.logprobs)} logprobs")


@runtime_checkable
class InferenceClient(Protocol):
    """What ``InferenceBackend.client(base_url, *, api_key, timeout)`` returns (one per replica).

    See ``prime_core.specs.InferenceBackend`` for who calls what, from where, and how errors
    are reported.
    """

    def health(self) -> bool: ...

    async def sample(self, request: SampleRequest) -> list[Sample]: ...

    async def load_weights(self, step: int, path: str) -> str | None: ...

    async def close(self) -> None: ...


def can_score(client) -> bool:
    """Whether the client can score given tokens (``prompt_logprobs``: an optional call, which a
    teacher server's backend needs for on-policy distillation)."""
    return callable(getattr(client, "prompt_logprobs", None))
