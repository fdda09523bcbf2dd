"""Contract suite for algorithms (``prime_core.specs.Algorithm``, ``advantage:<name>`` and
``loss:<name>``).

The orchestrator (its event loop, main thread) calls an advantage estimator once per group of
completions of one prompt: ``fn(rewards: list[float]) -> list[float]``, one advantage per
completion. The trainer (every rank, main thread) calls a loss once per packed row:
``fn(logprobs [N], inference_logprobs [N], advantages [N], **trainer.loss.kwargs) ->
(per_token_loss [N], {name: [N] diagnostics})``, all float32; it masks and sums the
per-token loss and back-propagates through ``logprobs``. This suite does the same::

    from prime_core.testing.contracts.algorithm import AlgorithmContract

    class TestGrpo(AlgorithmContract):
        name = "advantage:grpo"

It checks that an estimator returns one finite float per reward for groups of 1 to 16, equal
rewards included, the same for the same rewards and permuted with them; and that a loss
returns a finite per-token loss and per-token diagnostics of the row's shape, differentiable
in ``logprobs`` with a finite gradient that, on-policy, pushes up tokens with a positive
advantage and down those with a negative one.
"""

from __future__ import annotations

import math
import random
from typing import Any, ClassVar

from prime_core.testing.contracts import Contract, ContractError, expect

GROUPS = ([1.0], [0.0, 1.0], [0.5] * 8, [0.0, 0.25, 1.0, 1.0, 0.0, 0.75, 0.5, 0.125], [3.0, -2.0, 7.5] * 5 + [0.0])
"""Groups of rewards: one completion, a pair, all equal (no spread), typical, larger."""


def check_advantage(spec) -> None:
    for rewards in GROUPS:
        try:
            advantages = list(spec.fn(list(rewards)))
        except Exception as exc:
            raise ContractError(f"'{spec.key}' raised {type(exc).__name__} for the rewards {rewards}: {exc}") from exc
        expect(len(advantages) == len(rewards), f"'{spec.key}': {len(rewards)} rewards gave {len(advantages)} "
                                                "advantages")
        expect(all(isinstance(a, int | float) and math.isfinite(a) for a in advantages),
               f"'{spec.key}': advantages of {rewards} are not finite floats: {advantages}")
        expect(list(spec.fn(list(rewards))) == advantages, f"'{spec.key}': the same rewards gave other advantages")
        order = list(range(len(rewards)))
        random.Random(len(rewards)).shuffle(order)
        permuted = list(spec.fn([rewards[i] for i in order]))
        expect(all(math.isclose(permuted[j], advantages[i], rel_tol=1e-9, abs_tol=1e-12) for j, i in enumerate(order)),
               f"'{spec.key}': permuting the group's rewards did not permute their advantages")


def check_loss(spec, loss_kwargs: dict[str, Any] | None = None, n: int = 17) -> None:
    import torch

    generator = torch.Generator().manual_seed(0)
    inference = -torch.rand(n, generator=generator) * 3
    advantages = torch.randn(n, generator=generator)
    advantages[0] = 0.0
    for name, shift in (("on-policy", torch.zeros(n)), ("off-policy", torch.randn(n, generator=generator) * 0.3)):
        logprobs = (inference + shift).clamp(max=0).requires_grad_()
        try:
            result = spec.fn(logprobs, inference, advantages, **(loss_kwargs or {}))
        except Exception as exc:
            raise ContractError(f"'{spec.key}' raised {type(exc).__name__}: {exc}") from exc
        expect(isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict),
               f"'{spec.key}' must return (per_token_loss, diagnostics dict), got {type(result).__name__}")
        per_token, extra = result
        expect(isinstance(per_token, torch.Tensor) and tuple(per_token.shape) == (n,),
               f"'{spec.key}': per-token loss of shape {getattr(per_token, 'shape', None)}, expected ({n},)")
        expect(bool(torch.isfinite(per_token).all()), f"'{spec.key}' {name}: the per-token loss is not finite")
        for key, value in extra.items():
            expect(isinstance(value, torch.Tensor) and tuple(value.shape) == (n,),
                   f"'{spec.key}': diagnostic '{key}' must be a per-token tensor of shape ({n},)")
        (grad,) = torch.autograd.grad(per_token.sum(), logprobs)
        expect(bool(torch.isfinite(grad).all()), f"'{spec.key}' {name}: the gradient is not finite")
        if name == "on-policy":
            push = -grad * advantages.sign()
            expect(bool((push[advantages != 0] > 0).all()),
                   f"'{spec.key}': on-policy, minimising the loss must raise the log-probability of tokens with a "
                   "positive advantage and lower those with a negative one")


class AlgorithmContract(Contract):
    """Subclass with ``name`` (``advantage:<name>`` or ``loss:<name>``) set."""

    registry = "algorithms"
    loss_kwargs: ClassVar[dict[str, Any]] = {}
    """``trainer.loss.kwargs`` the loss is called with."""

    def test_meets_its_kinds_contract(self, spec):
        if spec.kind == "advantage":
            check_advantage(spec)
        else:
            check_loss(spec, self.loss_kwargs)
