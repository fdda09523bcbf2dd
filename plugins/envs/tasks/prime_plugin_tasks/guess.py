"""Guess a secret number with higher/lower replies. Each model turn is a guess; the environment
answers "higher", "lower" or "correct" (or asks for a number) until the guess is right or
``max_turns`` are used. Reward: 1.0 for a right first guess, one ``1 / max_turns`` less per
extra guess, 0.0 when it is never found.
"""

from __future__ import annotations

import random
import re

from prime_core.orchestrator.env import Task

SYSTEM = "Guess my number between {low} and {high}. Reply with one number; I say higher or lower."
_NUMBER = re.compile(r"-?\d+")


def guess_of(text: str) -> int | None:
    match = _NUMBER.search(text)
    return int(match.group()) if match and len(match.group()) < 12 else None


class Guess:
    def __init__(self, low: int = 1, high: int = 16, max_turns: int = 6) -> None:
        if low >= high:
            raise ValueError(f"guess: low ({low}) must be below high ({high})")
        if max_turns < 1:
            raise ValueError(f"guess: max_turns must be at least 1, got {max_turns}")
        self.low, self.high, self.max_turns = low, high, max_turns

    def tasks(self, rng: random.Random, n: int) -> list[Task]:
        out = []
        for _ in range(n):
            secret = rng.randint(self.low, self.high)
            system = SYSTEM.format(low=self.low, high=self.high)
            out.append(Task(prompt=[{"role": "system", "content": system}, {"role": "user", "content": "Your guess?"}],
                            answer=str(secret), info={"secret": secret}))
        return out

    def respond(self, task: Task, messages: list[dict], state: dict) -> dict | None:
        state["guesses"] = state.get("guesses", 0) + 1
        guess = guess_of(messages[-1]["content"])
        if guess == task.info["secret"]:
            state["found"] = True
            return None
        if state["guesses"] >= self.max_turns:
            return None
        if guess is None:
            return {"role": "user", "content": "Reply with a number."}
        return {"role": "user", "content": "higher" if guess < task.info["secret"] else "lower"}

    def score_episode(self, task: Task, episode) -> float:
        if not episode.state.get("found"):
            return 0.0
        return max(0.0, 1.0 - (episode.state["guesses"] - 1) / self.max_turns)

    def score(self, task: Task, completion: str) -> float:
        """The one-turn view: a right first guess."""
        return 1.0 if guess_of(completion) == task.info["secret"] else 0.0
