"""Config of supervised fine-tuning (``prime sft``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from prime_core.bench import BenchConfig
from prime_core.config.base import ExistingFile, NoSecrets, Section, Toggle
from prime_core.config.shared import CkptConfig, LogConfig, Monitors
from prime_core.launch.config import SFTDeployment, SFTSingleNodeDeployment, infer_deployment_type
from prime_core.trainer.config import OptimConfig, SchedulerConfig, TrainerModelConfig


class SFTDataConfig(Section):
    type: Literal["jsonl", "fake"] = "jsonl"
    path: ExistingFile | None = None
    """A local JSONL file of chat samples (``{"messages": [...]}`` per line)."""
    batch_size: int = Field(default=32, ge=1)
    pack: bool = True
    """Pack several samples into each ``seq_len`` sequence."""
    length: Literal["fixed", "variable"] = "fixed"
    """For ``type = "fake"``: fixed or variable sample lengths."""
    shuffle: bool = True
    seed: int = 0

    @model_validator(mode="after")
    def _path_for_jsonl(self) -> SFTDataConfig:
        if self.type == "jsonl" and self.path is None:
            raise ValueError('path is required when type = "jsonl" (or use type = "fake")')
        return self


class SFTConfig(Section):
    """Supervised fine-tuning on a chat dataset with packed sequences."""

    output_dir: Path = Path("outputs")
    model: TrainerModelConfig = Field(default_factory=TrainerModelConfig)
    data: SFTDataConfig = Field(default_factory=lambda: SFTDataConfig(type="fake"))
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=2e-5))
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    ckpt: CkptConfig = Field(default_factory=CkptConfig)
    max_steps: int | None = Field(default=None, ge=1)
    seq_len: int = Field(default=2048, ge=1)
    deployment: Annotated[SFTDeployment, infer_deployment_type] = Field(default_factory=SFTSingleNodeDeployment)
    monitors: Monitors = Field(default_factory=lambda: ["jsonl"])
    """Metric sinks (``prime plugins list``); ``jsonl`` is always written."""
    log: LogConfig = Field(default_factory=LogConfig)
    dry_run: bool = False
    """Write the resolved config and the launch plan, start nothing."""
    launcher: str = "auto"
    """Launcher plugin (``local``, ``torchrun``, ``slurm``); ``auto`` lets plugins decide."""
    env_vars: Annotated[dict[str, str], NoSecrets] = Field(default_factory=dict)
    """Extra environment variables for the training processes."""
    resume: bool = False
    """Continue from the newest complete checkpoint under ``output_dir/checkpoints``."""
    clean: bool = False
    """Delete the previous run's outputs in ``output_dir`` (its model, checkpoints, logs, metrics) first."""

    bench: Toggle[BenchConfig] = None
    """``--bench``: time a few steps on fake data and print step time, tokens/s, MFU and memory."""

    def problems(self) -> list[str]:
        """Keys that contradict each other (checked once the config is valid; ``config.load``)."""
        from prime_core.config.rl import clean_and_resume
        from prime_core.config.shared import looks_like_local_path
        from prime_core.model_folder import TOKENIZER_FILES

        problems = clean_and_resume(self)
        folder = Path(self.model.name).expanduser()
        if (self.model.tokenizer is None and looks_like_local_path(self.model.name) and folder.is_dir()
                and not any((folder / name).is_file() for name in TOKENIZER_FILES)):
            problems.append(f"model.name: {folder} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...), "
                            "which SFT needs: copy them from the model it was made from, or set model.tokenizer")
        return problems
