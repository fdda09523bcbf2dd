"""Config of supervised fine-tuning (``prime sft``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AliasChoices, Field, model_validator

from prime_core.bench import BenchConfig
from prime_core.config.base import ExistingFile, NoSecrets, Noted, Section, Toggle
from prime_core.config.shared import CkptConfig, LogConfig, Monitors, looks_like_local_path
from prime_core.launch.config import SFTDeployment, SFTSingleNodeDeployment, infer_deployment_type
from prime_core.trainer.config import OptimConfig, SchedulerConfig, TrainerModelConfig


class LossMaskConfig(Section):
    """Which messages of a chat are trained on, by role (``type = "sft"`` data)."""

    system: bool = False
    user: bool = False
    assistant: bool = True
    tool: bool = False


class SFTDataConfig(Section):
    type: Literal["jsonl", "sft", "fake"] = "jsonl"
    """``jsonl``: a local file (``path``); ``sft``: a ``datasets`` dataset (``name``, prime-rl's SFT
    data; the type when ``name`` is given); ``fake``: random tokens."""
    path: ExistingFile | None = None
    """A local JSONL file of chat samples (``{"messages": [...]}`` per line)."""
    name: str | None = None
    """``type = "sft"``: a Hugging Face dataset id (from the local cache when offline), a folder
    written by ``Dataset.save_to_disk``, a folder of data files, or a ``.jsonl``/``.parquet`` file.
    Rows hold ``messages``, or ``prompt`` and ``completion``."""
    splits: list[str] | None = None
    """Splits to read (``train`` when unset); with ``subsets``, paired one to one."""
    subsets: list[str] | None = None
    """Subsets (configurations) to read; unset: the dataset's default."""
    probabilities: list[float] | None = None
    """Sampling weight of each subset/split when there are several (unset: in turn)."""
    stopping_strategy: Literal["first_exhausted", "all_exhausted"] = "all_exhausted"
    """When interleaving several: stop with the first one used up, or go on until all are."""
    loss_mask: LossMaskConfig = Field(default_factory=LossMaskConfig)
    """Which messages are trained on (``type = "sft"``)."""
    batch_size: int = Field(default=32, ge=1)
    pack: bool = True
    """Pack several samples into each ``seq_len`` sequence."""
    length: Literal["fixed", "variable"] = "fixed"
    """For ``type = "fake"``: fixed or variable sample lengths."""
    shuffle: bool = True
    seed: int = 0

    micro_batch_size: Annotated[int | None, Noted(
        "prime packs samples into seq_len-long rows and accumulates them into batch_size (the same update); "
        "model.pass_tokens sets how many rows go through one forward pass")] = None
    pack_function: Annotated[Literal["cat", "stack"], Noted("prime packs by concatenation (cat)")] = "cat"
    input_ids: Annotated[Literal["increasing", "random"] | None, Noted("prime's fake tokens are random ids")] = None

    @model_validator(mode="before")
    @classmethod
    def _sft_when_named(cls, data: Any) -> Any:
        # prime-rl's SFT data is a datasets dataset by default ([data] name = ...).
        if isinstance(data, dict) and "type" not in data and data.get("name") is not None:
            data = {**data, "type": "sft"}
        return data

    @model_validator(mode="after")
    def _path_for_jsonl(self) -> SFTDataConfig:
        if self.type == "jsonl" and self.path is None:
            raise ValueError('path is required when type = "jsonl" (or name with type = "sft", or type = "fake")')
        if self.type == "sft" and self.name is None:
            raise ValueError('name is required when type = "sft": a datasets dataset id or a local path')
        if self.type == "sft" and looks_like_local_path(self.name) and not Path(self.name).expanduser().exists():
            raise ValueError(f"name: {self.name} does not exist (a local dataset: a save_to_disk folder, a folder of "
                             "data files, or a .jsonl/.parquet file)")
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
    """Tokens per packed row (prime-rl's ``data.seq_len`` and ``model.seq_len`` are accepted)."""
    dist_timeout_seconds: int = Field(default=600, ge=1)
    """Seconds a collective of the training processes may wait before the run fails."""
    matmul_precision: Literal["highest", "high", "medium"] = "highest"
    """``torch.set_float32_matmul_precision`` of the training processes."""
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
    clean: bool = Field(default=False, validation_alias=AliasChoices("clean", "clean_output_dir"))
    """Delete the previous run's outputs in ``output_dir`` (its model, checkpoints, logs, metrics) first
    (prime-rl's ``clean_output_dir``)."""

    bench: Toggle[BenchConfig] = None
    """``--bench``: time a few steps on fake data and print step time, tokens/s, MFU and memory."""

    prime_rl_keys: ClassVar[tuple[str, ...]] = ("data.seq_len", "model.seq_len")

    # prime-rl's SFT keys for parts prime does its own way.
    loss_impl: Annotated[str | None, Noted("prime's SFT loss is the masked token cross-entropy of the model")] = None
    tokenizer: Annotated[dict[str, Any] | None, Noted(
        "the tokenizer is model.tokenizer (model.chat_template for a template)")] = None
    renderer: Annotated[dict[str, Any] | None, Noted(
        "prime renders chats with the tokenizer's chat template (model.chat_template to replace it)")] = None
    val: Annotated[dict[str, Any] | None, Noted("prime's SFT has no validation pass")] = None
    gc: Annotated[dict[str, Any] | None, Noted("prime leaves Python's garbage collector as it is")] = None
    heartbeat: Annotated[dict[str, Any] | None, Noted("prime sends no heartbeats")] = None
    memory_profiler_path: Annotated[Any, Noted("prime's memory numbers come from `prime sft --bench`")] = None
    trace_path: Annotated[Any, Noted("prime writes no torch profiler trace")] = None
    experimental: Annotated[dict[str, Any] | None, Noted("prime has no experimental keys")] = None

    @model_validator(mode="before")
    @classmethod
    def _prime_rl_layout(cls, data: Any) -> Any:
        """prime-rl keeps the sequence length on ``[data]`` (0.5) or ``[model]`` (0.6); prime at the top;
        its ``tokenizer`` table is prime's ``model.tokenizer``."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for table in ("data", "model"):
            if isinstance(data.get(table), dict) and "seq_len" in data[table]:
                section = dict(data[table])
                data[table] = section
                data["seq_len"] = section.pop("seq_len")
        if isinstance(data.get("tokenizer"), dict) and isinstance(data.get("model", {}), dict):
            data["model"] = {**data.get("model", {}), "tokenizer": data.pop("tokenizer")}
        ckpt = data.get("ckpt")
        if isinstance(ckpt, dict) and ckpt.get("resume_step") is not None:
            data.setdefault("resume", True)
        return data

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
