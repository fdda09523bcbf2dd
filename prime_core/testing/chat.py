"""What the environment contract suite runs episodes with: a byte-level tokenizer with a ChatML
template (built locally, nothing downloaded) and a scripted policy.

The scripted policy stands in for the model in the suite only: it answers each request with
the next text of its script, encoded by the tokenizer, with made-up log-probabilities, so that
the suite can drive an environment through the turns it wants (right answers, tool calls,
garbage) and check the recorded trajectory against what was "sampled". Real sampling is
tested against vLLM (``tests/test_agentic_e2e.py``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from prime_core.inference.client import Sample, SampleRequest

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def chat_tokenizer():
    """One token per byte plus ``<|im_start|>``, ``<|im_end|>`` (end of turn) and ``<|endoftext|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    core = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", unk_token=None,
                                   chat_template=CHATML)


class ScriptedPolicy:
    """An async sampler (``Episode.sampler``) answering with ``script(request, turn)`` or the
    texts of a list in turn; records every request."""

    def __init__(self, tokenizer, script: list[str] | Callable[[SampleRequest, int], str]) -> None:
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_id
        texts = itertools.cycle(script) if isinstance(script, list) else None
        self.script = (lambda request, turn: next(texts)) if texts is not None else script
        self.requests: list[SampleRequest] = []
        self.samples: list[Sample] = []

    async def __call__(self, request: SampleRequest) -> list[Sample]:
        text = self.script(request, len(self.requests))
        self.requests.append(request)
        ids = self.tokenizer.encode(text, add_special_tokens=False)[: request.max_tokens]
        finish = "length"
        if len(ids) < request.max_tokens:
            ids, finish = [*ids, self.eos], "stop"
        logprobs = [-0.01 * (1 + (i % 7)) for i in range(len(ids))]
        sample = Sample(token_ids=ids, logprobs=logprobs, finish_reason=finish,
                        text=self.tokenizer.decode(ids, skip_special_tokens=True))
        self.samples.append(sample)
        return [sample]
