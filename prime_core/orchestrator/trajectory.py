"""The tokens of one rollout, exactly as the policy saw and sampled them.

A trajectory is a list of segments; each segment becomes one training sample. Model turns are
appended as the sampler returned them (token ids and their log-probabilities, loss mask 1);
everything else (the prompt, environment and tool turns, the template's turn markers) is
appended with loss mask 0. Nothing sampled is ever decoded and tokenized again.

Before each model turn the conversation is rendered whole with the tokenizer's chat template
(``add_generation_prompt=True``). When that rendering starts with the segment's tokens (the
"prefix property"), only the new tail is appended and the turns stay one sample. When it does
not (a template that drops earlier reasoning, a model that sampled a spelling the tokenizer
would not produce, a turn cut off mid-token) the segment is closed and a new one starts from
the fresh rendering: each sample stays exact, and the split is counted.

Why not the ``renderers`` package: it bridges turns with hand-written renderers per model
family (and falls back to one without tool support elsewhere), and pulls in openai,
openai-harmony, tiktoken and prime-pydantic-config. The check above works with any Hugging
Face chat template in a few lines; see docs/environments.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prime_core.orchestrator.batch import TrainingSample


def render(tokenizer, messages: list[dict], *, tools: list[dict] | None = None,
           add_generation_prompt: bool = True) -> list[int]:
    """``messages`` through the tokenizer's chat template, as token ids."""
    ids = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
                                        tokenize=True)
    if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


@dataclass
class Segment:
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def append(self, ids: list[int], *, sampled: bool, logprobs: list[float] | None = None) -> None:
        self.ids += ids
        self.mask += [1 if sampled else 0] * len(ids)
        self.logprobs += list(logprobs) if sampled else [0.0] * len(ids)

    def sample(self, **meta: Any) -> TrainingSample | None:
        """The segment as a training sample (prompt = the tokens before the first sampled one,
        trailing unsampled tokens dropped); ``None`` when nothing in it was sampled."""
        if 1 not in self.mask:
            return None
        first = self.mask.index(1)
        last = len(self.mask) - self.mask[::-1].index(1)
        return TrainingSample(self.ids[:first], self.ids[first:last], self.logprobs[first:last],
                              completion_mask=self.mask[first:last], **meta)


@dataclass
class Trajectory:
    segments: list[Segment] = field(default_factory=list)
    splits: int = 0
    """How often the prefix broke (segments - 1 once started)."""

    @property
    def context(self) -> list[int]:
        """What the policy sees next: the current segment's tokens."""
        return self.segments[-1].ids if self.segments else []

    def extend_to(self, rendered: list[int]) -> None:
        """Make the current segment ``rendered`` (the whole conversation, rendered): append its
        tail when the segment is a prefix of it, otherwise start a new segment."""
        if not self.segments:
            self.segments.append(Segment())
        current = self.segments[-1]
        if rendered[:len(current.ids)] == current.ids:
            current.append(rendered[len(current.ids):], sampled=False)
            return
        self.splits += 1
        fresh = Segment()
        fresh.append(rendered, sampled=False)
        self.segments.append(fresh)

    def add_sampled(self, ids: list[int], logprobs: list[float]) -> None:
        if len(ids) != len(logprobs):
            raise ValueError(f"{len(ids)} sampled tokens but {len(logprobs)} log-probabilities")
        self.segments[-1].append(list(ids), sampled=True, logprobs=logprobs)

    @property
    def sampled_tokens(self) -> int:
        return sum(sum(s.mask) for s in self.segments)

    def samples(self, **meta: Any) -> list[TrainingSample]:
        return [s for s in (segment.sample(**meta) for segment in self.segments) if s is not None]
