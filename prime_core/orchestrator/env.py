"""The environment contract: what an environment plugin's ``load(**args)`` returns.

An environment hands out tasks and scores completions:

- ``tasks(rng, n) -> list[Task]``: ``n`` tasks drawn with ``rng`` (a ``random.Random`` the
  orchestrator seeds per step, so a resumed run sees the same tasks);
- ``score(task, completion) -> float``: the reward of one completion (higher is better;
  built-in tasks use [0, 1]).

A ``Task``'s prompt is a list of chat messages, so a task can carry a multi-turn history; the
policy writes the next assistant turn. ``answer`` is a reference completion when the task has
one (used to make SFT data for a warm-up, ``prime envs sft-data``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class Task:
    prompt: list[dict[str, str]]
    answer: str | None = None
    info: dict[str, Any] = field(default_factory=dict)


class Env(Protocol):
    def tasks(self, rng: random.Random, n: int) -> list[Task]: ...

    def score(self, task: Task, completion: str) -> float: ...
