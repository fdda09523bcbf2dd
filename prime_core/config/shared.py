"""Sections shared by several roles. At the top of an RL config they propagate down into
``trainer``, ``orchestrator`` and ``inference`` unless a role sets its own value."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from prime_core.config.base import Noted, Section, Selects

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
    chat_template: str | None = None
    """A Jinja2 chat template (the text, or a file holding it) used instead of the tokenizer's own,
    by every role that renders chats (and vLLM's ``--chat-template``)."""
    vlm: dict[str, Any] | None = None
    """prime-rl's vision-language settings: refused, prime trains and serves text-only models."""

    prime_rl_keys: ClassVar[tuple[str, ...]] = ("tokenizer.name", "tokenizer.trust_remote_code",
                                                "tokenizer.chat_template")

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

    @field_validator("vlm")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("prime trains and serves text-only models (no vision encoder, no image inputs): remove "
                             "[model.vlm] and use a text model, or train this one with prime-rl")
        return value

    @model_validator(mode="before")
    @classmethod
    def _tokenizer_table(cls, data: Any) -> Any:
        # prime-rl 0.6 spells the tokenizer as a table ([tokenizer] name = ...) beside the model.
        if isinstance(data, dict) and isinstance(data.get("tokenizer"), dict):
            data = dict(data)
            table = dict(data["tokenizer"])
            data["tokenizer"] = table.pop("name", None)
            if table.get("trust_remote_code") is not None:
                data.setdefault("trust_remote_code", table.pop("trust_remote_code"))
            table.pop("trust_remote_code", None)
            if table.get("chat_template") is not None:
                data["chat_template"] = table.pop("chat_template")
            table.pop("chat_template", None)
            if table:
                raise ValueError(f"tokenizer: unknown key(s) {', '.join(sorted(table))} (name, trust_remote_code, "
                                 "chat_template)")
        return data

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


def chat_template_text(template: str | None) -> str | None:
    """``chat_template`` as template text: a file's content when it names a file."""
    if template is None or "{" in template:
        return template
    path = Path(template).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"chat_template: {template} is neither a Jinja2 template nor a file")
    return path.read_text()


def use_chat_template(tokenizer, model: ModelRef):
    """The tokenizer with the config's ``chat_template`` in place of its own (when one is set)."""
    if model.chat_template is not None:
        tokenizer.chat_template = chat_template_text(model.chat_template)
    return tokenizer


class TokenizerRef(ModelRef):
    """The model whose tokenizer a role uses (the orchestrator: it never loads the weights)."""

    needs_weights: ClassVar[bool] = False

    lora: Annotated[dict[str, Any] | None, Noted(
        "prime names the adapter it trains and serves itself (trainer.model.lora turns LoRA on)")] = None


class CkptConfig(Section):
    """Checkpointing of the trainer (and the orchestrator's progress)."""

    interval: int | None = Field(default=None, ge=1)
    """Save every N steps; off when unset."""
    keep_last: int | None = Field(default=None, ge=1)
    """Keep only the newest N checkpoints (and those ``keep_interval`` keeps)."""
    keep_interval: int | None = Field(default=None, ge=1)
    """Keep the checkpoints of every N-th step for good (step 100, 200, ... for 100), whatever
    ``keep_last`` says."""
    resume_step: int | None = Field(default=None, ge=-1)
    """Resume from the checkpoint of this step (``-1``: the newest usable one), as ``--resume``
    does from the newest; unset: start afresh (or as ``resume`` says)."""
    skip_optimizer: bool = False
    """On resume, load the model's weights but start the optimizer afresh."""

    # prime-rl's other checkpoint keys: prime's checkpoint is one thing (model + optimizer, with
    # the step in progress.json) under output_dir/checkpoints.
    output_dir: Annotated[Path | None, Noted(
        "prime keeps checkpoints and published weights under output_dir (checkpoints/, weights/); set output_dir "
        "to place them")] = None
    skip_scheduler: Annotated[bool, Noted(
        "prime's learning-rate schedule is a function of the step, restored with it")] = False
    skip_progress: Annotated[bool, Noted(
        "prime always resumes at the checkpoint's step (its progress.json); to start counting afresh from these "
        "weights, point model.name at a published weights/step_N folder instead")] = False
    skip_dataloader: Annotated[bool, Noted(
        "prime's data order is a function of seed and step, restored with the step")] = False
    skip_buffer: Annotated[bool, Noted("prime's orchestrator keeps no sample buffer in its checkpoint")] = False
    skip_gather_master_weights: Annotated[bool, Noted(
        "prime's checkpoint holds sharded state only; full Hugging Face weights are what weights/step_N holds")
    ] = False
    weights_only: Annotated[bool, Noted(
        "prime's checkpoints always hold the optimizer state (resumable); weights/step_N holds the weights alone")
    ] = False
    weights: Annotated[dict[str, Any] | None, Noted(
        "prime publishes each step's weights as safetensors under output_dir/weights/step_N (LoRA: the adapter, "
        "with its base named); its checkpoints are resumable torch.distributed.checkpoint state")] = None
    wait_for_weights_timeout: Annotated[int | None, Noted(
        "the orchestrator waits for weights as orchestrator.weights_timeout says")] = None

    @field_validator("weights", mode="before")
    @classmethod
    def _weights_table(cls, value: Any) -> Any:
        return {} if value is True else value


Monitors = Annotated[list[str], Selects("monitors", each=True)]
"""Metric sinks by name (``prime plugins list``). ``jsonl`` (``metrics.jsonl``) is always
written: the run's progress display and ``--resume`` read it. A monitor whose plugin adds a
config table (``[NAME]``) is also selected by that table being present."""


class WeightBroadcastConfig(Section):
    """How new trainer weights reach the inference servers."""

    type: Annotated[str, Selects("weight_transports")] = "filesystem"
    """A weight transport provided by a plugin (``filesystem``, ``nccl``)."""

    # prime-rl's other transport settings. The `nccl` transport's own keys (host, port, timeout,
    # inference_world_size) are its plugin's (prime-plugin-vllm).
    quantize_in_weight_transfer: Annotated[bool, Noted("prime sends weights in their training dtype")] = False
    save_format: Annotated[str | None, Noted("prime publishes weights as safetensors")] = None
    save_sharded: Annotated[bool | None, Noted("prime publishes weights as safetensors the server loads")] = None


class LogConfig(Section):
    level: Literal["debug", "info", "warning", "error"] = "info"

    # prime-rl's other logging keys. prime writes one text log per role under output_dir/logs
    # and every metric to metrics.jsonl.
    json_logging: Annotated[bool, Noted(
        "prime's role logs are text lines under output_dir/logs; metrics.jsonl holds every metric as JSON")] = False
    interval: Annotated[float | None, Noted("prime's roles log once per step")] = None
    log_data: Annotated[bool, Noted("prime does not log a data sample at start-up")] = False
    vf_level: Annotated[str | None, Noted("the environments' logs follow log.level in prime")] = None
    file: Annotated[Any, Noted("prime always writes each role's log to output_dir/logs")] = None
    env_worker_logs: Annotated[Any, Noted("prime runs environments inside the orchestrator; its log has theirs")
                               ] = None
    ranks_filter: Annotated[Any, Noted("prime writes one log per trainer rank under output_dir/logs")] = None


def model_section(config, root: str):
    """``(the trained model's section, its dotted key)`` of a config of ``root``: ``trainer.model``
    in an RL config, ``model`` in a trainer or SFT config; ``(None, "")`` for other roots."""
    if root == "rl":
        trainer = getattr(config, "trainer", None)
        return getattr(trainer, "model", None), "trainer.model"
    if root in ("trainer", "sft"):
        return getattr(config, "model", None), "model"
    return None, ""
