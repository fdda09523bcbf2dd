"""Sections shared by several roles. At the top of an RL config they propagate down into
``trainer``, ``orchestrator`` and ``inference`` unless a role sets its own value."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from prime_core.config.base import Section, Selects

ROLES = ("trainer", "orchestrator", "inference")
"""The role processes of an RL run (``prime run``), each with a config of its own."""


def looks_like_local_path(name: str) -> bool:
    """Whether a model name is meant as a folder here rather than a Hugging Face id."""
    return name.startswith(("/", "./", "../", "~"))


def local_folder_missing(name: str) -> bool:
    """A name that looks like a local folder (``looks_like_local_path``) but is not one."""
    return looks_like_local_path(str(name)) and not Path(name).expanduser().is_dir()


class ModelRef(Section):
    """Which model to train and serve."""

    name: str = "Qwen/Qwen3-0.6B"
    """A Hugging Face model id or a local folder with a Hugging Face checkpoint."""
    tokenizer: str | None = None
    """Tokenizer to use when it differs from the model's own."""
    trust_remote_code: bool = False
    """Allow custom modelling code shipped with the checkpoint."""

    needs_tokenizer: ClassVar[bool] = True
    """Whether the role reading this section tokenizes (the RL trainer does not)."""
    needs_weights: ClassVar[bool] = True
    """Whether it loads the model (the orchestrator only tokenizes)."""

    @field_validator("name")
    @classmethod
    def _local_folder_exists(cls, name: str) -> str:
        if local_folder_missing(name):
            if Path(name).expanduser().exists():
                raise ValueError(f"{name} is a file: a model is a folder (config.json, weights, tokenizer)")
            raise ValueError(f"model folder not found: {name}")
        return name

    @model_validator(mode="after")
    def _local_folder_loads(self) -> ModelRef:
        folder = Path(self.name).expanduser()
        if looks_like_local_path(self.name) and folder.is_dir():
            from prime_core.model_folder import problems

            found = problems(folder, tokenizer=self.needs_tokenizer and self.tokenizer is None,
                             weights=self.needs_weights)
            if found:
                raise ValueError("; ".join(found))
        return self


class TokenizerRef(ModelRef):
    """The model whose tokenizer a role uses (the orchestrator: it never loads the weights)."""

    needs_weights: ClassVar[bool] = False


class CkptConfig(Section):
    """Checkpointing of the trainer (and the orchestrator's progress)."""

    interval: int | None = Field(default=None, ge=1)
    """Save every N steps; off when unset."""
    keep_last: int | None = Field(default=None, ge=1)
    """Keep only the newest N checkpoints."""


Monitors = Annotated[list[str], Selects("monitors", each=True)]
"""Metric sinks by name (``prime plugins list``). ``jsonl`` (``metrics.jsonl``) is always
written: the run's progress display and ``--resume`` read it. A monitor whose plugin adds a
config table (``[NAME]``) is also selected by that table being present."""


class WeightBroadcastConfig(Section):
    """How new trainer weights reach the inference servers."""

    type: Annotated[str, Selects("weight_transports")] = "filesystem"
    """A weight transport provided by a plugin (``filesystem``, ``nccl``)."""


class LogConfig(Section):
    level: Literal["debug", "info", "warning", "error"] = "info"


def model_section(config, root: str):
    """``(the trained model's section, its dotted key)`` of a config of ``root``: ``trainer.model``
    in an RL config, ``model`` in a trainer or SFT config; ``(None, "")`` for other roots."""
    if root == "rl":
        trainer = getattr(config, "trainer", None)
        return getattr(trainer, "model", None), "trainer.model"
    if root in ("trainer", "sft"):
        return getattr(config, "model", None), "model"
    return None, ""
