"""The pipelined step loop (``prime sft``, ``--bench`` with ``pipelined``): a step queued before
the one before it is read trains exactly as step by step, and every step is timed from its
start or the end of the step before it."""

import copy
import random
from types import SimpleNamespace

import pytest


def _training(model):
    import torch

    from prime_core.distributed import World

    policy = SimpleNamespace(model=model, before_step=[], before_backward=[], update=None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return SimpleNamespace(world=World(device=str(next(model.parameters()).device)), policy=policy,
                           optimizer=optimizer, pass_tokens=2048,
                           scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0))


def _steps(vocab: int, n: int) -> list[list[dict]]:
    rng = random.Random(0)
    steps = []
    for _ in range(n):
        rows = []
        for _ in range(3):
            length = rng.randrange(8, 40)
            rows.append({"input_ids": [rng.randrange(vocab) for _ in range(length)],
                         "position_ids": list(range(length)),
                         "loss_mask": [0] * 3 + [1] * (length - 3)})
        steps.append(rows)
    return steps


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_step_queued_before_the_one_before_is_read_trains_the_same(device):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from prime_core.trainer.step import queue_train_step, train_step

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)).to(device)
    steps = _steps(64, 4)

    one_by_one = _training(copy.deepcopy(model))
    want = [train_step(one_by_one, rows, max_norm=1.0) for rows in steps]

    pipelined = _training(copy.deepcopy(model))
    got, pending = [], None
    for rows in steps:
        read = queue_train_step(pipelined, rows, max_norm=1.0)
        if pending:
            got.append(pending())
        pending = read
    got.append(pending())

    for a, b in zip(want, got, strict=True):
        a.pop("rows"), b.pop("rows")
        assert a == b
    assert len({s["loss"] for s in got}) == len(steps), "every step read its own sums"
    want_state, got_state = one_by_one.policy.model.state_dict(), pipelined.policy.model.state_dict()
    assert all(torch.equal(want_state[k], got_state[k]) for k in want_state)


def test_a_step_is_timed_from_its_start_or_the_end_of_the_step_before():
    from prime_core.trainer.step import StepClock

    clock = StepClock("cpu")  # on the host, marks are clock readings
    assert clock.step_time(1.0, 3.0) == 2.0
    # queued while the step before still ran: from that step's end
    assert clock.step_time(2.5, 4.0) == 1.0
    # queued after the device went idle: from its own start
    assert clock.step_time(5.0, 5.5) == 0.5
    assert isinstance(clock.mark(), float)


@pytest.mark.gpu
def test_steps_queued_ahead_on_a_gpu_are_timed_from_the_end_of_the_step_before():
    import time

    import torch

    from prime_core.trainer.step import StepClock

    clock = StepClock("cuda")
    a = torch.randn(4096, 4096, device="cuda")
    (a @ a).sum().item()  # the matmul's first launch is not a step's
    torch.cuda.synchronize()
    wall = time.perf_counter()
    marks = []
    for _ in range(3):  # all queued before any is timed, as a pipelined loop does
        start = clock.mark()
        for _ in range(50):
            a @ a
        marks.append((start, clock.mark()))
    times = [clock.step_time(*pair) for pair in marks]
    torch.cuda.synchronize()
    wall = time.perf_counter() - wall
    assert 0.8 * wall < sum(times) <= wall, (times, wall)
    assert max(times) < 1.3 * min(times), times


def test_the_sums_keep_every_key_and_a_token_count_past_float32s_integers():
    import torch

    from prime_core.trainer.step import SUM_KEYS, queue_sums

    sums = queue_sums({"loss": torch.tensor(1.5)}, 2**24 + 1, grad_norm=torch.tensor(0.25))()
    assert sums == {**dict.fromkeys(SUM_KEYS, 0.0), "loss": 1.5, "tokens": 2**24 + 1, "grad_norm": 0.25}
