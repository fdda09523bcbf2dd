"""SFT samples from a ``datasets`` dataset (``[data] type = "sft"``, prime-rl's SFT data).

``data.name`` is a Hugging Face dataset id (read from the local cache when the roles run
offline), a folder written by ``Dataset.save_to_disk``, a folder of data files, or one
``.jsonl`` / ``.parquet`` file (``prime_core.hf_data``). Subsets and splits pair up as in
prime-rl: both lists zip pairwise, ``subsets`` alone take the ``train`` split, ``splits`` alone
the default subset; several are interleaved (``probabilities``, ``stopping_strategy``).

A row is a chat in one of prime-rl's two formats: ``messages`` (the whole chat is the sample),
or ``prompt`` and ``completion`` (each a list of messages or a string: the user's and the
assistant's). Tokens are rendered with the tokenizer's chat template message by message; a
message's tokens are trained when ``data.loss_mask`` names its role (assistant turns by
default: the turn's content through its end-of-turn token, never the header before it).
"""

from __future__ import annotations

from typing import Any

from prime_core.errors import ConfigError
from prime_core.orchestrator.batch import TrainingSample


def subsets_and_splits(data) -> list[tuple[str | None, str]]:
    if data.subsets is not None and data.splits is not None:
        if len(data.subsets) != len(data.splits):
            raise ConfigError([f"data.subsets ({len(data.subsets)}) and data.splits ({len(data.splits)}) pair up "
                               "one to one: give lists of the same length"])
        return list(zip(data.subsets, data.splits, strict=True))
    if data.subsets is not None:
        return [(subset, "train") for subset in data.subsets]
    return [(None, split) for split in (data.splits or ["train"])]


def load_rows(data) -> Any:
    """The rows of ``data.name``, every subset/split pair, interleaved into one dataset."""
    from prime_core.hf_data import DatasetUnavailable
    from prime_core.hf_data import load_rows as load_split

    parts = []
    for subset, split in subsets_and_splits(data):
        try:
            parts.append(load_split(data.name, subset, split, who="sft", key="data.name"))
        except DatasetUnavailable as exc:
            raise ConfigError([f"data.name: {exc}"]) from None
    if len(parts) == 1:
        return parts[0]
    if data.probabilities is not None and len(data.probabilities) != len(parts):
        raise ConfigError([f"data.probabilities has {len(data.probabilities)} entries for {len(parts)} "
                           "subset/split pairs"])
    import datasets

    return datasets.interleave_datasets(parts, probabilities=data.probabilities, seed=data.seed,
                                        stopping_strategy=data.stopping_strategy)


def _messages(value: Any, role: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, dict):
        return [{"role": role, **value}]
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        return [{"role": role, **m} if "role" not in m else dict(m) for m in value]
    raise ValueError(f"expected a string or a list of messages, got {type(value).__name__}")


def row_messages(row: dict) -> list[dict]:
    """The chat of one row: its ``messages``, or its ``prompt`` followed by its ``completion``."""
    if row.get("messages") is not None:
        return _messages(row["messages"], "assistant")
    if row.get("prompt") is not None and row.get("completion") is not None:
        return _messages(row["prompt"], "user") + _messages(row["completion"], "assistant")
    raise ValueError("a row needs a 'messages' column, or both 'prompt' and 'completion'")


def _render(tokenizer, messages: list[dict], *, generation_prompt: bool = False) -> list[int]:
    if not messages:
        return []
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def _extend(ids: list[int], longer: list[int]) -> list[int]:
    if longer[: len(ids)] != ids:
        raise ValueError("the chat template does not extend the earlier turns with the next one, so the turns "
                         "cannot be masked apart (set model.chat_template to one that does)")
    return longer[len(ids):]


def masked_sample(tokenizer, messages: list[dict], loss_mask) -> TrainingSample:
    """Token ids of the whole chat, trained where ``loss_mask`` names the message's role."""
    ids: list[int] = []
    mask: list[int] = []
    eos = tokenizer.eos_token_id
    for i, message in enumerate(messages):
        role = message.get("role")
        if role == "assistant":  # the header the generation prompt adds is never trained
            header = _extend(ids, _render(tokenizer, messages[:i], generation_prompt=True))
            ids, mask = ids + header, mask + [0] * len(header)
        span = _extend(ids, _render(tokenizer, messages[: i + 1]))
        trained = len(span) if getattr(loss_mask, str(role), False) else 0
        if trained and role == "assistant" and eos in span:  # through end of turn, not the newline after
            trained = span.index(eos) + 1
        ids, mask = ids + span, mask + [1] * trained + [0] * (len(span) - trained)
    if 1 not in mask:
        raise ValueError("no token to train on (data.loss_mask names none of this chat's roles)")
    first, end = mask.index(1), len(mask) - mask[::-1].index(1)  # untrained tokens after the last turn go
    completion = ids[first:end]
    return TrainingSample(ids[:first], completion, [0.0] * len(completion), 1.0, 0.0, 0,
                          completion_mask=mask[first:end])


def load_samples(data, tokenizer) -> list[TrainingSample]:
    rows = load_rows(data)
    samples = []
    for number, row in enumerate(rows):
        try:
            samples.append(masked_sample(tokenizer, row_messages(row), data.loss_mask))
        except (ValueError, TypeError) as exc:
            raise ConfigError([f"data.name: {data.name}, row {number}: {exc}"]) from None
    if not samples:
        raise ConfigError([f"data.name: {data.name} has no rows"])
    return samples
