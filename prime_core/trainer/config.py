"""Config of the trainer role (``prime trainer``), with prime-rl's key names."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator

from prime_core.bench import BenchConfig
from prime_core.config.base import Noted, Requires, Section, Selects, Toggle
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
    pass_tokens: int = Field(default=2048, ge=1)
    """Tokens one forward pass may hold: packed rows shorter than this are stacked, padded to
    the step's longest, into one pass (a model implementation without ``Packing``, e.g.
    ``hf``, with no fused LM head and no context parallelism; the others take one row per
    pass). Short rows then make fewer, larger matrix products; memory is that of one row of
    ``pass_tokens``."""
    kernels: Annotated[dict[str, str], Selects("kernels", mapping=True)] = Field(default_factory=dict)
    """Kernels by op, from the kernel registry (``op:name``), for the model implementation
    to use, e.g. ``{rmsnorm = "NAME", swiglu = "NAME"}``; ``prime plugins list`` shows them."""

    # prime-rl's model keys that tune its own implementation.
    moe_use_grouped_mm: Annotated[bool | None, Noted(
        "prime's MoE experts use the grouped-GEMM kernel the model implementation and the kernels plugins choose "
        "(trainer.model.kernels)")] = None
    freeze_moe_router: Annotated[bool, Noted("prime trains the MoE router with the rest of the model")] = False
    index_cache: Annotated[Any, Noted("prime's model implementations keep no sparse-attention index cache")] = None
    debug: Annotated[dict[str, Any] | None, Noted(
        "prime builds the checkpoint's model as it is; for a small debug model use `prime model tiny DIR`")] = None


class OptimConfig(Section):
    type: Literal["adamw", "sgd", "muon", "sign_sgd"] = "adamw"
    """``adamw``; ``sgd`` (with ``momentum``, ``nesterov``); ``muon`` (orthogonalised momentum for the
    hidden weight matrices, AdamW with ``betas`` for embeddings, the LM head, norms and biases);
    ``sign_sgd`` (``-lr · sign(grad)``, decoupled weight decay, no state)."""
    lr: float = Field(default=1e-6, gt=0)
    weight_decay: float = Field(default=0.01, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's (β1, β2) (prime-rl's ``betas1`` / ``betas2`` are accepted too)."""
    max_norm: float | None = Field(default=1.0, gt=0)
    """Gradient-norm clipping; off when unset."""
    momentum: float = Field(default=0.9, ge=0, lt=1)
    """``sgd``'s momentum factor."""
    nesterov: bool = True
    """``sgd`` and ``muon``: Nesterov momentum."""
    mu: float = Field(default=0.95, ge=0, lt=1)
    """``muon``'s momentum factor."""

    prime_rl_keys: ClassVar[tuple[str, ...]] = ("betas1", "betas2")

    @model_validator(mode="before")
    @classmethod
    def _split_betas(cls, data: Any) -> Any:
        # prime-rl spells AdamW's betas as two keys.
        if isinstance(data, dict) and ("betas1" in data or "betas2" in data):
            data = dict(data)
            first, second = tuple(data.get("betas") or (0.9, 0.999))
            data["betas"] = (data.pop("betas1", first), data.pop("betas2", second))
        return data


class SchedulerConfig(Section):
    """The learning rate over the steps, as prime-rl defines it: ``constant`` (after an optional
    warmup); ``linear`` (warmup-stable-decay: linear warmup from ``min_lr``, constant, then a linear
    decay to ``min_lr`` over the last ``decay_steps`` steps); ``cosine`` (warmup, then a cosine from
    ``lr`` to ``min_lr`` by ``max_steps``)."""

    type: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int | None = Field(default=None, ge=0)
    """Steps of linear warmup; unset: 0 for ``constant``, 10 for ``linear`` and ``cosine`` (prime-rl's)."""
    decay_steps: int = Field(default=10, ge=0)
    """``linear``: steps of the final decay to ``min_lr`` (needs ``max_steps``)."""
    min_lr: float = Field(default=0.0, ge=0)
    """The learning rate warmup starts from and decay ends at."""

    @property
    def warmup(self) -> int:
        if self.warmup_steps is not None:
            return self.warmup_steps
        return 0 if self.type == "constant" else 10


LOSS_KEYS = {"dppo_mask_low": "mask_low", "dppo_mask_high": "mask_high", "ipo_mask_low": "mask_low",
             "ipo_mask_high": "mask_high", "adv_tau": "adv_tau", "kl_tau": "kl_tau", "teacher_tau": "teacher_tau"}
"""prime-rl's loss keys (0.5: ``ipo_mask_*``, 0.6: ``dppo_mask_*``; 0.5's ``teacher_tau``, the weight of
the teacher's log-ratio in each token's advantage) and the default loss's keyword."""


class LossConfig(Section):
    type: Annotated[str, Selects("algorithms", prefix="loss:", skip=("custom",))] = "default"
    """A loss registered by a plugin through ``prime_algorithms``, or ``custom`` (``import_path``)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the loss (e.g. masking thresholds). prime-rl's keys of the default
    loss (``dppo_mask_low``/``high``, 0.5's ``ipo_mask_low``/``high``, ``adv_tau``, ``kl_tau``,
    ``teacher_tau``) set the same keywords of prime's default loss."""
    prime_rl_keys: ClassVar[tuple[str, ...]] = (*LOSS_KEYS, "ipo_threshold")

    import_path: str | None = None
    """``type = "custom"``: the loss function as ``module.function`` (prime-rl's custom loss); it is
    called as the default loss is: ``(logprobs, inference_logprobs, advantages, **kwargs)`` and
    returns the per-token loss and a dict of per-token diagnostics."""

    @model_validator(mode="before")
    @classmethod
    def _prime_rl_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and "ipo_threshold" in data:
            raise ValueError("ipo_threshold: prime-rl's IPO loss (type = \"ipo\") is not in prime; its default loss "
                             "masks by probability difference (dppo_mask_low / dppo_mask_high), or add a loss plugin")
        if not isinstance(data, dict) or not LOSS_KEYS.keys() & data.keys():
            return data
        data = dict(data)
        kwargs = dict(data.get("kwargs") or {})
        for key, keyword in LOSS_KEYS.items():
            if key in data:
                kwargs.setdefault(keyword, data.pop(key))
        data["kwargs"] = kwargs
        return data

    @model_validator(mode="after")
    def _custom_needs_path(self) -> LossConfig:
        if (self.type == "custom") != (self.import_path is not None):
            raise ValueError('a custom loss is type = "custom" with import_path = "module.function", both together')
        return self

    def function(self, manager):
        """The loss function this section selects."""
        if self.type == "custom":
            import importlib

            from prime_core.errors import ConfigError

            module, _, name = self.import_path.rpartition(".")
            try:
                return getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError, ValueError) as exc:
                raise ConfigError([f"trainer.loss.import_path = {self.import_path!r}: cannot import it ({exc})"]
                                  ) from None
        return manager.select("algorithms", f"loss:{self.type}", key="trainer.loss.type", shown=self.type).fn


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
    """Tokens per packed training sequence (prime-rl 0.6's ``trainer.model.seq_len`` is accepted)."""
    resume: bool = False
    """Continue from the newest complete checkpoint under ``output_dir/checkpoints``
    (``ckpt.resume_step`` picks another)."""
    dist_timeout_seconds: int = Field(default=600, ge=1)
    """Seconds a collective of the trainer's process group may wait before the run fails."""
    matmul_precision: Literal["highest", "high", "medium"] = "highest"
    """``torch.set_float32_matmul_precision`` of the trainer (``high`` allows TF32 on GPUs)."""
    batch_timeout: float | None = Field(default=3600.0, gt=0)
    """Seconds to wait for the orchestrator's batch of a step; then the trainer stops, naming
    the file it waited for. ``None``: wait for ever."""
    seed: int = 0
    monitors: Monitors = Field(default_factory=lambda: ["jsonl"])
    """Metric sinks (``prime plugins list``); ``jsonl`` is always written."""
    log: LogConfig = Field(default_factory=LogConfig)

    prime_rl_keys: ClassVar[tuple[str, ...]] = ("model.seq_len", "data.fake.seq_len")

    # prime-rl's trainer keys for parts prime does its own way.
    max_async_level: Annotated[int | None, Noted(
        "the orchestrator's async_level bounds how far sampling runs ahead; the trainer takes each step's batch")
    ] = None
    rollout_transport: Annotated[dict[str, Any] | None, Noted(
        "batches reach the trainer as files under output_dir/rollouts (orchestrator.batch_format)")] = None
    tokenizer: Annotated[dict[str, Any] | None, Noted(
        "the RL trainer trains on token ids and loads no tokenizer (model.tokenizer names the orchestrator's)")] = None
    gc: Annotated[dict[str, Any] | None, Noted("prime leaves Python's garbage collector as it is")] = None
    heartbeat: Annotated[dict[str, Any] | None, Noted(
        "prime sends no heartbeats; metrics.jsonl and the role logs show progress")] = None
    metrics_server: Annotated[dict[str, Any] | None, Noted(
        "prime serves no metrics endpoint; metrics go to metrics.jsonl and the monitors")] = None
    memory_profiler_path: Annotated[Any, Noted(
        "prime's memory numbers come from `prime trainer --bench` (peak memory per step)")] = None
    trace_path: Annotated[Any, Noted("prime writes no torch profiler trace")] = None
    enable_router_replay: Annotated[bool, Noted("prime does not replay MoE routing decisions of inference")] = False
    enable_token_export: Annotated[bool, Noted("prime exports no tokens beyond the step batches under rollouts/")
                                   ] = False
    max_concurrent_runs: Annotated[int | None, Noted(
        "prime trains one run per trainer (prime-rl's multi-run LoRA training is not part of prime)")] = None

    @model_validator(mode="before")
    @classmethod
    def _prime_rl_layout(cls, data: Any) -> Any:
        # prime-rl 0.6 keeps the sequence length on the model table; prime on the trainer's.
        if isinstance(data, dict) and isinstance(data.get("model"), dict) and "seq_len" in data["model"]:
            model = dict(data["model"])
            data = {**data, "model": model}
            data["seq_len"] = model.pop("seq_len")  # the role's own value wins over a top-level seq_len
        table = data.get("data") if isinstance(data, dict) else None
        fake = table.get("fake") if isinstance(table, dict) else None
        if isinstance(fake, dict) and "seq_len" in fake:  # prime-rl's fake data has its own; prime's is the trainer's
            fake = dict(fake)
            data = {**data, "data": {**data["data"], "fake": fake}}
            data["seq_len"] = fake.pop("seq_len")
        return data

    @model_validator(mode="after")
    def _resume_step(self) -> TrainerConfig:
        if self.ckpt.resume_step is not None:
            self.resume = True
        return self

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
