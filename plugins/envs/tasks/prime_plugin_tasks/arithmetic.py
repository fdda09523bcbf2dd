"""Add two random integers. Reward: 1.0 when the reply is exactly the sum, else 0.0."""

from __future__ import annotations

import random

from prime_core.orchestrator.env import Task

SYSTEM = "Add the numbers. Reply with the result only."


class Arithmetic:
    def __init__(self, digits: int = 1, operands: int = 2) -> None:
        if digits < 1 or operands < 2:
            raise ValueError(f"arithmetic: need digits >= 1 and operands >= 2, got {digits}, {operands}")
        self.digits, self.operands = digits, operands

    def tasks(self, rng: random.Random, n: int) -> list[Task]:
        out = []
        for _ in range(n):
            numbers = [rng.randrange(10 ** self.digits) for _ in range(self.operands)]
            question = "+".join(str(x) for x in numbers)
            out.append(Task(prompt=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                            answer=str(sum(numbers)), info={"numbers": numbers}))
        return out

    def score(self, task: Task, completion: str) -> float:
        return 1.0 if completion.strip() == task.answer else 0.0
