"""prime-rl's rollout filters (``orchestrator.pre_batch_filters`` / ``post_batch_filters``):
which training samples a filter detects. Only tokens the policy sampled are looked at (tool and
environment turns carry no log-probability of the policy)."""

from __future__ import annotations

import math

from prime_core.orchestrator.batch import TrainingSample


def _sampled(sample: TrainingSample):
    for token, logprob, keep in zip(sample.completion_ids, sample.completion_logprobs, sample.mask, strict=True):
        if keep:
            yield token, logprob


def gibberish(sample: TrainingSample, config, vocab_size: int) -> bool:
    """A rare token (id above ``token_id_threshold``, late in BPE merge order) sampled at a
    log-probability below that of a uniform guess minus ``logprob_offset``."""
    floor = -math.log(vocab_size) - config.logprob_offset
    return any(token > config.token_id_threshold and logprob < floor for token, logprob in _sampled(sample))


def repetition(sample: TrainingSample, config, vocab_size: int) -> bool:
    """``window`` tokens in a row each sampled at a probability above ``prob_threshold``."""
    threshold, run = math.log(config.prob_threshold), 0
    for _, logprob in _sampled(sample):
        run = run + 1 if logprob > threshold else 0
        if run >= config.window:
            return True
    return False


def zero_advantage(sample: TrainingSample, config, vocab_size: int) -> bool:
    """A sample that teaches nothing: its advantage is 0 (its group all scored alike)."""
    return sample.advantage == 0


DETECT = {"gibberish": gibberish, "repetition": repetition, "zero_advantage": zero_advantage}


def apply(filters, samples: list[TrainingSample], vocab_size: int, counts: dict[str, int]) -> list[TrainingSample]:
    """The samples no enforced filter detects; every detection is counted in ``counts`` by type."""
    kept = []
    for sample in samples:
        drop = False
        for config in filters:
            if DETECT[config.type](sample, config, vocab_size):
                counts[config.type] = counts.get(config.type, 0) + 1
                drop = drop or config.enforce
        if not drop:
            kept.append(sample)
    return kept


def masked(filters, samples: list[TrainingSample], vocab_size: int, counts: dict[str, int]) -> list[TrainingSample]:
    """The samples, with those an enforced filter detects kept in the batch but trained on
    nowhere (their loss mask all 0): a step's batch keeps its shape. Detections are counted."""
    from dataclasses import replace

    kept = {id(s) for s in apply(filters, samples, vocab_size, counts)}
    return [s if id(s) in kept else replace(s, completion_mask=[0] * len(s.completion_ids)) for s in samples]
