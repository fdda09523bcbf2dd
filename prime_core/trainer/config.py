"""Config of the trainer role (``prime trainer``), with prime-rl's key names."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from prime_core.bench import BenchConfig
from prime_core.config.base import Requires, Section, Selects, Toggle
from prime_core.config.shared import CkptConfig, LogConfig, ModelRef, WandbSection, WeightBroadcastConfig
from prime_core.trainer.fake import FakeDataConfig


class CompileConfig(Section):
    """``torch.compile`` of the transformer blocks."""

    fullgraph: bool = False


class ACConfig(Section):
    """Activation checkpointing."""

    mode: Literal["full", "selective"] = "full"
    freq: int = Field(default=1, ge=1)
    """Checkpoint every ``freq`` blocks (1 = every block)."""
    targets: list[Literal["norm", "attn_proj", "attention", "mlp_proj", "mlp"]] = Field(
        default_factory=lambda: ["norm"], min_length=1)
    """Sub-modules recomputed in ``selective`` mode: ``norm`` (normalisation layers), ``attn_proj``
    (q/k/v/o projections), ``attention``, ``mlp_proj`` (gate/up/down projections), ``mlp``."""


class ACOffloadingConfig(Section):
    """Offload checkpointed activations to CPU memory."""

    max_inflight_activations: int = Field(default=5, ge=1)


class LoRAConfig(Section):
    rank: int = Field(default=16, ge=1)
    alpha: float = 32.0
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    modules_to_save: list[str] = Field(default_factory=list)


class TrainerModelConfig(ModelRef):
    """The trained model and how it is built, sharded and checkpointed."""

    impl: Annotated[str, Selects("model_impls", skip=("auto",))] = "auto"
    """Model implementation: ``hf``, ``custom`` or ``auto`` (custom where supported)."""
    attn: str = "sdpa"
    """Attention kernel: ``sdpa``, ``flash_attention_2``, ``flash_attention_3``, ..."""
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Parameter dtype during compute."""
    # FSDP settings: a non-default value needs the `fsdp` strategy, so it is never silently ignored.
    reduce_dtype: Annotated[Literal["bfloat16", "float32"],
                            Requires("parallel_strategies", "fsdp", when=lambda m: m.reduce_dtype != "float32")] = "float32"
    optimization_dtype: Annotated[
        Literal["bfloat16", "float32"],
        Requires("parallel_strategies", "fsdp", when=lambda m: m.optimization_dtype != "float32"),
    ] = "float32"
    compile: Annotated[Toggle[CompileConfig], Requires("parallel_strategies", "compile")] = None
    ac: Annotated[Toggle[ACConfig], Requires("parallel_strategies", "ac")] = None
    ac_offloading: Annotated[Toggle[ACOffloadingConfig], Requires("parallel_strategies", "ac_offloading")] = None
    lora: Annotated[Toggle[LoRAConfig], Requires("parallel_strategies", "lora")] = None
    reshard_after_forward: Annotated[bool, Requires("parallel_strategies", "fsdp",
                                                    when=lambda m: not m.reshard_after_forward)] = True
    fsdp_cpu_offload: Annotated[bool, Requires("parallel_strategies", "fsdp")] = False
    """Parameters, gradients and optimizer state on CPU."""
    optim_cpu_offload: bool = False
    """Optimizer state in CPU memory between steps."""
    dp_replicate: Annotated[int, Requires("parallel_strategies", "fsdp", when=lambda m: m.dp_replicate > 1)] = Field(
        default=1, ge=1
    )
    """HSDP: replicate × shard."""
    ep: Annotated[int, Requires("parallel_strategies", "ep", when=lambda m: m.ep > 1)] = Field(default=1, ge=1)
    """Expert-parallel degree; must divide the number of experts."""
    ep_comm_backend: Annotated[str, Selects("ep_backends", when=lambda m: m.ep > 1)] = "torch"
    deepep_num_sms: int | None = Field(default=None, ge=1)
    deepep_token_chunk_size: int | None = Field(default=None, ge=1)
    cp: Annotated[int, Requires("parallel_strategies", "cp", when=lambda m: m.cp > 1)] = Field(default=1, ge=1)
    """Context-parallel degree."""
    cp_style: Literal["ring", "ulysses"] = "ring"
    fused_lm_head_token_chunk_size: Annotated[
        int | Literal["auto", "disabled"],
        Requires("kernels", "lm_head:fused", when=lambda m: m.fused_lm_head_token_chunk_size != "disabled"),
    ] = "disabled"
    quantization: Annotated[Literal["fp8"] | None, Requires("kernels", "fp8_linear:*")] = None
    kernels: dict[str, str] = Field(default_factory=dict)
    """Kernels by op, from the kernel registry (``op:name``): ``rmsnorm``, ``swiglu``, ``rope``
    for native models (``{rmsnorm = "liger", swiglu = "liger", rope = "liger"}``), ``hf_patch``
    for the hf implementation (``{hf_patch = "liger"}``); ``lm_head`` picks the implementation
    of the fused LM head when ``fused_lm_head_token_chunk_size`` is on (``fused``: Triton on
    CUDA, PyTorch elsewhere; ``fused_torch``, ``fused_triton``, ``liger``)."""

    @model_validator(mode="after")
    def _incompatible(self) -> TrainerModelConfig:
        # The combinations prime-rl's docs rule out, refused before anything starts.
        problems = []
        if self.fsdp_cpu_offload and self.optim_cpu_offload:
            problems.append("fsdp_cpu_offload and optim_cpu_offload are mutually exclusive: fsdp_cpu_offload "
                            "already keeps optimizer state on CPU; set only one")
        for key, degree in (("ep", self.ep), ("cp", self.cp)):
            if degree > 1 and self.impl == "hf":
                problems.append(f"{key} = {degree} needs impl = 'custom' (or 'auto' for a supported family): "
                                "the Hugging Face implementation has no expert/context parallel layers")
        if problems:
            raise ValueError("; ".join(problems))
        return self


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
    seed: int = 0
    wandb: WandbSection = None
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
