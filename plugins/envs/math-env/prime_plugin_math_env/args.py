"""The arguments of ``math-env``, with prime-rl's math-env names and defaults (those of its
options that run without a network or a sandbox)."""

from __future__ import annotations

from pydantic import Field, model_validator

from prime_core.config.base import Section

INSTRUCTION_PROMPT = "Solve the following problem. Make sure to put the answer (and only answer) inside \\boxed{}.\n\n"


class MathEnvArgs(Section):
    dataset_name: str = "PrimeIntellect/INTELLECT-3-RL"
    """A dataset id (read through ``datasets.load_dataset``, from the local cache when offline), a
    local folder (data files, or one written by ``save_to_disk``) or a data file (``.jsonl``,
    ``.json``, ``.parquet``, ``.csv``)."""
    dataset_subset: str | None = "math"
    """The dataset's config (``load_dataset``'s ``name``)."""
    dataset_split: str = "train"
    dataset_shuffle: bool = False
    """Shuffle the rows (with ``dataset_seed``) before tasks are drawn from them."""
    dataset_seed: int = 42
    question_key: str = "question"
    """The column holding the problem."""
    answer_key: str = "answer"
    """The column holding the answer (plain, or a solution whose last ``\\boxed{}`` is it)."""
    difficulty_key: str | None = None
    """A column of per-problem average rewards; only rows within [min_avg_reward, max_avg_reward] are kept."""
    min_avg_reward: float = 0.0
    max_avg_reward: float = 1.0
    system_prompt: str | None = None
    instruction_prompt: str = INSTRUCTION_PROMPT
    """Put before each problem."""
    instruction_prompt_post: str = ""
    """Put after each problem."""
    math_verify_timeout: int = Field(default=5, ge=1)
    """Seconds math-verify may spend parsing or comparing one answer; a check still running well
    past that is killed and scores 0."""
    math_verify_max_workers: int = Field(default=4, ge=1)
    """Processes checking answers at once (started when needed)."""

    @model_validator(mode="after")
    def _range(self) -> MathEnvArgs:
        if self.min_avg_reward > self.max_avg_reward:
            raise ValueError(f"min_avg_reward ({self.min_avg_reward}) must not exceed max_avg_reward "
                             f"({self.max_avg_reward})")
        return self
