"""The built-in algorithms meet the algorithm contract, and the suite fails on estimators and
losses that break it."""

import statistics

import pytest
import torch

from prime_core.algorithms import default_loss, grpo_advantages
from prime_core.specs import Algorithm
from prime_core.testing.contracts import ContractError
from prime_core.testing.contracts import algorithm as contract
from prime_core.testing.contracts.algorithm import AlgorithmContract


class TestGrpo(AlgorithmContract):
    name = "advantage:grpo"
    plugin = "prime_core.builtin"


class TestDefaultLoss(AlgorithmContract):
    name = "loss:default"
    plugin = "prime_core.builtin"


def advantage(fn):
    return Algorithm(name="mine", kind="advantage", fn=fn)


def loss(fn):
    return Algorithm(name="mine", kind="loss", fn=fn)


@pytest.mark.parametrize(("fn", "message"), [
    (lambda r: [(x - statistics.mean(r)) / statistics.pstdev(r) for x in r],
     "raised ZeroDivisionError for the rewards \\[1.0\\]"),
    (lambda r: [x - statistics.mean(r) for x in r[:-1]], "rewards gave .* advantages"),
    (lambda r: [x - r[0] for x in r], "did not permute"),
])
def test_broken_estimators_fail(fn, message):
    with pytest.raises(ContractError, match=message):
        contract.check_advantage(advantage(fn))


def test_the_built_in_estimator_survives_equal_rewards():
    assert grpo_advantages([0.5] * 4) == [0.0] * 4


def wrong_sign(logprobs, inference, advantages, **kwargs):
    per_token, extra = default_loss(logprobs, inference, advantages, **kwargs)
    return -per_token, extra


def summed(logprobs, inference, advantages, **kwargs):
    per_token, extra = default_loss(logprobs, inference, advantages, **kwargs)
    return per_token.sum(), extra


def log_of_ratio(logprobs, inference, advantages, **kwargs):
    ratio = torch.exp(logprobs - inference)
    return -advantages * torch.log(ratio - 1), {}  # NaN/inf where the policies agree


@pytest.mark.parametrize(("fn", "message"), [
    (wrong_sign, "must raise the log-probability of tokens with a positive advantage"),
    (summed, "per-token loss of shape"),
    (log_of_ratio, "not finite"),
    (lambda *args, **kwargs: default_loss(*args, **kwargs)[0], "must return \\(per_token_loss, diagnostics dict\\)"),
])
def test_broken_losses_fail(fn, message):
    with pytest.raises(ContractError, match=message):
        contract.check_loss(loss(fn))
