"""Config of the trainer role (``prime trainer``), with prime-rl's key names."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator

from prime_core.bench import BenchConfig
from prime_core.config.base import Requires, Section, Selects, Toggle
from prime_core.config.shared import CkptConfig, LogConfig, ModelRef, Monitors, WeightBroadcastConfig
from prime_core.trainer.fake import FakeDataConfig


class TrainerModelConfig(ModelRef):
    """The trained model and how it is built. Plugins add their own keys here (the parallel
    strategies' degrees and settings, kernels' options: ``prime config show`` lists them)."""

    needs_tokenizer: ClassVar[bool] = False  # the RL trainer trains on token ids (SFT checks its own)

    impl: Annotated[str, Selects("model_impls", skip=("auto",))] = "auto"
    """Model implementation from a plugin (``prime plugins list``); ``auto`` takes the
    highest-priority implementation that supports the checkpoint."""
    attn: str = "auto"
    """Attention kernel: ``auto`` (a plugin picks the fastest exact kernel for this run when
    the trainer starts, e.g. torch's fused kernels on a GPU in bf16; otherwise the model
    implementation's default, ``sdpa``), ``sdpa``, or a kernel registered as
    ``attention:<name>``."""
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Parameter dtype during compute."""
    optimization_dtype: Annotated[
        Literal["bfloat16", "float32"],
        Requires("parallel_strategies", slot="data_parallel", when=lambda m: m.optimization_dtype != "float32"),
    ] = "float32"
    """Master weights and optimizer state. Different from ``dtype``, it needs a data-parallel
    strategy, which keeps the master weights and computes in ``dtype`` (mixed precision);
    without one the parameters are simply held in ``dtype``."""
    optim_cpu_offload: bool = False
    """Optimizer state in CPU memory between steps."""
    kernels: Annotated[dict[str, str], Selects("kernels", mapping=True)] = Field(default_factory=dict)
    """Kernels by op, from the kernel registry (``op:name``), for the model implementation
    to use, e.g. ``{rmsnorm = "NAME", swiglu = "NAME"}``; ``prime plugins list`` shows them."""


class OptimConfig(Section):
    type: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(default=1e-6, gt=0)
    weight_decay: float = Field(default=0.01, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    max_norm: float | None = Field(default=1.0, gt=0)
    """Gradient-norm clipping; off when unset."""


class SchedulerConfig(Section):
    type: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(default=0, ge=0)


class LossConfig(Section):
    type: Annotated[str, Selects("algorithms", prefix="loss:")] = "default"
    """A loss registered by a plugin through ``prime_algorithms``."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the loss (e.g. masking thresholds)."""


class TrainerDataConfig(Section):
    fake: Toggle[FakeDataConfig] = None
    """Train on random batches instead of the orchestrator's (``--data.fake``, used by ``--bench``)."""


class TrainerConfig(Section):
    """The trainer role: reads batches, computes the RL loss, publishes weights."""

    output_dir: Path = Path("outputs")
    model: TrainerModelConfig = Field(default_factory=TrainerModelConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    ckpt: CkptConfig = Field(default_factory=CkptConfig)
    weight_broadcast: WeightBroadcastConfig = Field(default_factory=WeightBroadcastConfig)
    data: TrainerDataConfig = Field(default_factory=TrainerDataConfig)
    bench: Toggle[BenchConfig] = None
    """``--bench``: time a few steps on fake data and print step time, tokens/s, MFU and memory."""
    max_steps: int | None = Field(default=None, ge=1)
    seq_len: int = Field(default=2048, ge=1)
    resume: bool = False
    """Continue from the newest complete checkpoint under ``output_dir/checkpoints``."""
    batch_timeout: float | None = Field(default=3600.0, gt=0)
    """Seconds to wait for the orchestrator's batch of a step; then the trainer stops, naming
    the file it waited for. ``None``: wait for ever."""
    seed: int = 0
    monitors: Monitors = Field(default_factory=lambda: ["jsonl"])
    """Metric sinks (``prime plugins list``); ``jsonl`` is always written."""
    log: LogConfig = Field(default_factory=LogConfig)

    @model_validator(mode="before")
    @classmethod
    def _optim_offload_alias(cls, data: Any) -> Any:
        # The memory guide spells it `[trainer.optim] optim_cpu_offload`; the key lives on model.
        if isinstance(data, dict) and isinstance(data.get("optim"), dict) and "optim_cpu_offload" in data["optim"]:
            optim = dict(data["optim"])
            model = dict(data.get("model") or {})
            model.setdefault("optim_cpu_offload", optim.pop("optim_cpu_offload"))
            data = {**data, "optim": optim, "model": model}
        return data
