"""Evaluation: k rollouts on each of a fixed set of examples, summarised per environment.

``avg@k`` is the mean reward over all rollouts; ``pass@j`` (for j = 1, 2, 4, ... up to k, and
k itself) is the unbiased estimator of Chen et al. (2021): with ``n`` rollouts of an example of
which ``c`` are correct, ``1 - C(n - c, j) / C(n, j)``, averaged over examples. A rollout is
correct when its reward reaches ``threshold`` (1.0: the environments' full reward).

The orchestrator runs an evaluation at step 0 and every ``orchestrator.eval.interval`` steps,
as tasks on its event loop beside training's rollouts (sharing the inference servers, at most
``max_concurrent`` eval rollouts at once); ``prime eval`` runs one on its own.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

CORRECT = 1.0 - 1e-6


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of ``k`` rollouts drawn from ``n`` (``c`` correct) is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(k):
        miss *= (n - c - i) / (n - i)
    return 1.0 - miss


def ks(n: int) -> list[int]:
    out, k = [], 1
    while k <= n:
        out.append(k)
        k *= 2
    return out if out[-1] == n else [*out, n]


def summarize(rewards: list[list[float]], *, threshold: float = CORRECT) -> dict[str, float]:
    """``avg@k`` and ``pass@j`` of per-example reward lists (each of the same length k)."""
    n = len(rewards[0])
    out = {f"avg@{n}": sum(map(sum, rewards)) / (n * len(rewards))}
    for k in ks(n):
        out[f"pass@{k}"] = sum(pass_at_k(n, sum(r >= threshold for r in rs), k) for rs in rewards) / len(rewards)
    return out


RunOne = Callable[[str, Any, Any, str], Awaitable[Any]]
"""``run_one(env_name, env, task, session_id) -> Outcome`` (``episode.Outcome``)."""


async def evaluate(envs: list[tuple[str, Any]], run_one: RunOne, *, num_examples: int, k: int, seed: int,
                   max_concurrent: int, tag: str = "eval",
                   per_env: dict[str, tuple[int | None, int | None]] | None = None) -> dict[str, Any]:
    """Every environment's fixed examples, ``k`` rollouts each (``per_env``: an environment's own
    ``(num_examples, k)``, ``None`` parts taking the defaults). Returns the metrics, nested per
    environment (``{name: {"avg@k": ..., "pass@1": ..., "env_errors": ...}}``), and ``time``."""
    start = time.perf_counter()
    gate = asyncio.Semaphore(max_concurrent)

    async def one(name, env, task, session):
        async with gate:
            return await run_one(name, env, task, session)

    metrics: dict[str, Any] = {}
    defaults = (num_examples, k)
    for name, env in envs:
        own = (per_env or {}).get(name, (None, None))
        count, k = (o if o is not None and o > 0 else d for o, d in zip(own, defaults, strict=True))
        tasks = env.tasks(random.Random(seed), count)
        # An example's rollouts are one session (their first turns go as one request).
        outcomes = await asyncio.gather(*(one(name, env, task, f"{tag}-{name}-{e}")
                                          for e, task in enumerate(tasks) for _ in range(k)))
        errors = sum(o.error is not None for o in outcomes)
        # A rollout that raised scores 0: it counts against the policy as a failed attempt would.
        rewards = [[o.reward if o.error is None else 0.0 for o in outcomes[e * k:(e + 1) * k]]
                   for e in range(len(tasks))]
        turns = [o.episode.turns for o in outcomes]
        metrics[name] = {**summarize(rewards), "env_errors": errors, "turns": sum(turns) / len(turns),
                         "examples": len(tasks)}
    metrics["time"] = time.perf_counter() - start
    return metrics
