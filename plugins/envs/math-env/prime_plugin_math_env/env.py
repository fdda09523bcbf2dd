"""math-env: a problem per task from a ``datasets`` dataset; reward 1 when the completion's
boxed answer is the reference answer as math (math-verify), else 0."""

from __future__ import annotations

import random

from prime_core.hf_data import load_rows
from prime_core.orchestrator.env import Task
from prime_plugin_math_env.args import MathEnvArgs
from prime_plugin_math_env.check import MathChecker, final_answer, reference_answer


class MathEnv:
    def __init__(self, args: MathEnvArgs) -> None:
        rows = load_rows(args.dataset_name, args.dataset_subset, args.dataset_split)
        shown = f"math-env: dataset '{args.dataset_name}' (split '{args.dataset_split}')"
        columns = {"question_key": args.question_key, "answer_key": args.answer_key,
                   "difficulty_key": args.difficulty_key}
        for key, column in columns.items():
            if column is not None and column not in rows.column_names:
                raise ValueError(f"{key}: {shown} has no column '{column}'; its columns are "
                                 f"{', '.join(rows.column_names)}")
        if args.difficulty_key is not None:
            low, high, key = args.min_avg_reward, args.max_avg_reward, args.difficulty_key
            rows = rows.filter(lambda row: row[key] is not None and low <= row[key] <= high)
        if args.dataset_shuffle:
            rows = rows.shuffle(seed=args.dataset_seed)
        if len(rows) == 0:
            raise ValueError(f"{shown} has no rows" + (
                f" with {args.difficulty_key} in [{args.min_avg_reward}, {args.max_avg_reward}]"
                if args.difficulty_key else ""))
        self.rows = rows.select_columns([args.question_key, args.answer_key])
        self.args = args
        self.checker = MathChecker(args.math_verify_timeout, args.math_verify_max_workers)

    def tasks(self, rng: random.Random, n: int) -> list[Task]:
        out = []
        system = [{"role": "system", "content": self.args.system_prompt}] if self.args.system_prompt else []
        for _ in range(n):
            index = rng.randrange(len(self.rows))
            row = self.rows[index]
            question = f"{self.args.instruction_prompt}{row[self.args.question_key]}{self.args.instruction_prompt_post}"
            gold = reference_answer(str(row[self.args.answer_key]))
            out.append(Task(prompt=[*system, {"role": "user", "content": question}], answer=f"\\boxed{{{gold}}}",
                            info={"index": index, "gold": gold}))
        return out

    def score(self, task: Task, completion: str) -> float:
        answer = final_answer(completion)
        if answer is None or not task.info["gold"]:
            return 0.0
        return 1.0 if self.checker.check(task.info["gold"], answer) else 0.0

    def close(self) -> None:
        self.checker.close()


def load(**args) -> MathEnv:
    from pydantic import ValidationError

    try:
        validated = MathEnvArgs.model_validate(args, strict=True)
    except ValidationError as exc:  # the orchestrator reports it under orchestrator.env[i].args
        raise ValueError("; ".join(f"{'.'.join(map(str, e['loc'])) + ': ' if e['loc'] else ''}"
                                   f"{e['msg'].removeprefix('Value error, ')}" for e in exc.errors())) from None
    return MathEnv(validated)
