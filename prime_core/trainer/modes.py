"""Which loss a step's batch is trained with: prime-rl 0.6's training modes.

The orchestrator writes its ``training_mode`` into every batch (``orchestrator.training_mode``)
and the trainer follows the batch, as prime-rl's trainer does (``setup_loss_fns``):

- ``rl``: the configured loss (``trainer.loss``), with its keywords. prime-rl 0.5's
  distillation lives here: with the teacher's log-probabilities in the batch and
  ``trainer.loss.teacher_tau > 0`` the default loss adds ``teacher_tau`` times the teacher's
  log-ratio to each token's advantage.
- ``opd``: on-policy distillation. The default loss with prime-rl 0.6's fixed knobs: the
  reward advantage is dropped (``adv_tau = 0``), the teacher's log-ratio is the whole advantage
  (``teacher_tau = 1``), masking at 0.2 both ways and ``kl_tau = 1e-3``, whatever
  ``trainer.loss`` says (it tunes the ``rl`` mode only).
- ``sft``: the negative log-likelihood of the sampled tokens (the teacher's rollouts).
"""

from __future__ import annotations

from typing import Any

OPD_KWARGS: dict[str, Any] = {"adv_tau": 0.0, "teacher_tau": 1.0, "mask_low": 0.2, "mask_high": 0.2, "kl_tau": 1e-3}
"""prime-rl 0.6's ``opd_loss_fn``: the default loss's math with these knobs hard-coded."""


def loss_for(mode: str, loss_config, manager) -> tuple[Any, dict[str, Any]]:
    """``(loss_fn, keyword arguments)`` for a batch of ``mode``."""
    from prime_core.errors import PrimeError

    if mode == "rl":
        return loss_config.function(manager), dict(loss_config.kwargs)
    if mode == "opd":
        fn = manager.select("algorithms", "loss:default", key="trainer.loss.type", shown="default").fn
        return fn, dict(OPD_KWARGS)
    if mode == "sft":
        return manager.select("algorithms", "loss:sft", key="trainer.loss.type", shown="sft").fn, {}
    raise PrimeError(f"a batch says training_mode = {mode!r}, which this trainer does not know (rl, opd, sft)",
                     hint="run the orchestrator and the trainer of the same prime version")


def check_teacher_logprobs(mode: str, rows: list[dict], step: int) -> None:
    """An ``opd`` batch without the teacher's log-probabilities cannot be trained as prime-rl does:
    say so instead of training on zeros."""
    from prime_core.errors import PrimeError

    if mode == "opd" and not any("teacher_logprobs" in row for row in rows):
        raise PrimeError(f"the batch of step {step} is training_mode = 'opd' but carries no teacher "
                         "log-probabilities", hint="the orchestrator needs orchestrator.teacher (its model and server)")
