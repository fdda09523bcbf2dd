"""A reasoning-gym dataset as a prime environment.

A task is the dataset's item at an index drawn from the orchestrator's ``rng``; items are
generated from the dataset's seed and the index alone, so the same draws give the same
problems in every process. The reward is the dataset's own ``score_answer`` of what
reasoning-gym's ``extract_answer`` finds in the completion (the last ``<answer>...</answer>``),
exactly as reasoning-gym scores a model.
"""

from __future__ import annotations

import random

from prime_core.orchestrator.env import Task
from prime_plugin_reasoning_gym.args import ReasoningGymArgs


class ReasoningGym:
    def __init__(self, args: ReasoningGymArgs) -> None:
        from reasoning_gym.utils import SYSTEM_PROMPTS

        self.name = args.dataset
        self.dataset = args.build()
        prompt = args.system_prompt
        self.system_prompt = SYSTEM_PROMPTS.get(prompt, prompt) if prompt is not None else None

    def tasks(self, rng: random.Random, n: int) -> list[Task]:
        out = []
        for _ in range(n):
            index = rng.randrange(len(self.dataset))
            entry = self.dataset[index]
            system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            # Some datasets accept many answers and give none: no reference completion then.
            answer = None if entry["answer"] is None else f"<answer>{entry['answer']}</answer>"
            out.append(Task(prompt=[*system, {"role": "user", "content": entry["question"]}], answer=answer,
                            info={"dataset": self.name, "index": index, "entry": entry}))
        return out

    def score(self, task: Task, completion: str) -> float:
        from reasoning_gym.utils import extract_answer

        try:
            return float(self.dataset.score_answer(extract_answer(completion), task.info["entry"]))
        except Exception:  # noqa: BLE001 - several scorers raise on answers they cannot parse
            return 0.0  # (prime_factorization: int('x')); an unparseable answer is a wrong one


def load(**args) -> ReasoningGym:
    from pydantic import ValidationError

    try:
        return ReasoningGym(ReasoningGymArgs.model_validate(args))
    except ValidationError as exc:  # the orchestrator reports it under orchestrator.env[i].args
        raise ValueError("; ".join(f"{'.'.join(map(str, e['loc'])) + ': ' if e['loc'] else ''}"
                                   f"{e['msg'].removeprefix('Value error, ')}" for e in exc.errors())) from None
