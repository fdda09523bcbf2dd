"""Reverse a short random string. Reward: how close the reply is to the exact reversal
(difflib's similarity ratio, 1.0 for an exact match), so partial progress is rewarded."""

from __future__ import annotations

import difflib
import random
import string

from prime_core.orchestrator.env import Task

SYSTEM = "Reverse the text character by character. Reply with the reversed text only."

LEARNABLE_TASK = ["--orchestrator.env",
                  '[{"id": "reverse_text", "args": {"alphabet": "ab", "min_len": 4, "max_len": 4}}]',
                  "--trainer.optim.lr", "3e-3", "--trainer.scheduler.warmup-steps", "0",
                  "--orchestrator.batch-size", "64"]
"""``prime run`` arguments of the end-to-end tests: a signal a random tiny model learns within a
few steps (reply with the letters of strings over "ab", partial credit)."""
LEARNABLE = [*LEARNABLE_TASK,
             # two servers on one CPU machine: let the OS place their workers (vLLM binds each to core 0)
             "--inference.env", '{"VLLM_CPU_OMP_THREADS_BIND": "nobind"}']
"""``LEARNABLE_TASK``, for a run that starts its own vLLM server(s)."""


class ReverseText:
    def __init__(self, min_len: int = 3, max_len: int = 6, alphabet: str = string.ascii_lowercase) -> None:
        if not 1 <= min_len <= max_len:
            raise ValueError(f"reverse_text: need 1 <= min_len <= max_len, got {min_len}, {max_len}")
        if not alphabet:
            raise ValueError("reverse_text: alphabet must not be empty")
        self.min_len, self.max_len, self.alphabet = min_len, max_len, alphabet

    def tasks(self, rng: random.Random, n: int) -> list[Task]:
        out = []
        for _ in range(n):
            text = "".join(rng.choice(self.alphabet) for _ in range(rng.randint(self.min_len, self.max_len)))
            out.append(Task(prompt=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
                            answer=text[::-1], info={"text": text}))
        return out

    def score(self, task: Task, completion: str) -> float:
        return difflib.SequenceMatcher(None, completion.strip(), task.answer).ratio()
