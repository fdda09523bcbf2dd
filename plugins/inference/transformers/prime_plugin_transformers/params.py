"""A sampling request as the server reads it (``POST /v1/sample``), checked before it is queued."""

from __future__ import annotations

from dataclasses import dataclass

GREEDY_TOP_P = 1e-9
"""Top-p of a temperature-0 request: at least one token is always kept, here only the argmax."""


class BadRequest(ValueError):
    """The request cannot be served as it is (HTTP 400)."""


@dataclass(frozen=True)
class Params:
    prompt_ids: list[int]
    n: int
    max_tokens: int
    temperature: float
    top_p: float
    stop_token_ids: tuple[int, ...]

    @classmethod
    def parse(cls, body: dict, *, vocab_size: int, max_model_len: int) -> Params:
        try:
            params = cls(prompt_ids=[int(t) for t in body["prompt_ids"]], n=int(body.get("n", 1)),
                         max_tokens=int(body["max_tokens"]), temperature=float(body.get("temperature", 1.0)),
                         top_p=float(body.get("top_p", 1.0)),
                         stop_token_ids=tuple(int(t) for t in body.get("stop_token_ids") or ()))
        except (KeyError, TypeError, ValueError) as exc:
            raise BadRequest(f"malformed sampling request ({type(exc).__name__}: {exc})") from None
        bad = [t for t in params.prompt_ids if not 0 <= t < vocab_size]
        if not params.prompt_ids or bad:
            raise BadRequest(f"prompt token ids must be in [0, {vocab_size}) (the model's vocabulary); got "
                             f"{bad[:5] if bad else 'an empty prompt'}")
        if params.n < 1 or params.max_tokens < 1 or params.temperature < 0 or not 0 < params.top_p <= 1:
            raise BadRequest(f"need n >= 1, max_tokens >= 1, temperature >= 0 and 0 < top_p <= 1 (got n={params.n}, "
                             f"max_tokens={params.max_tokens}, temperature={params.temperature}, top_p={params.top_p})")
        if len(params.prompt_ids) + params.max_tokens > max_model_len:
            raise BadRequest(f"the prompt ({len(params.prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) "
                             f"exceed the model's maximum length of {max_model_len} tokens "
                             "(inference.model.max_model_len)")
        return params

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def processor_kwargs(self) -> dict[str, float]:
        if self.greedy:
            return {"temperature": 1.0, "top_p": GREEDY_TOP_P}
        return {"temperature": self.temperature, "top_p": self.top_p}
