"""Config of the orchestrator role (``prime orchestrator``), with prime-rl's key names."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, Field, model_validator

from prime_core.config.base import Section, Selects
from prime_core.config.shared import CkptConfig, LogConfig, Monitors, TokenizerRef, WeightBroadcastConfig
from prime_core.inference.config import ApiKeyRef


class ClientConfig(ApiKeyRef):
    """How the orchestrator reaches the inference servers (through the backend's client)."""

    base_url: list[str] = Field(default_factory=lambda: ["http://127.0.0.1:8000/v1"], min_length=1)
    """One URL per inference replica; a single string is accepted."""
    api_key_var: str = "OPENAI_API_KEY"
    """Environment variable holding the API key, if the servers need one (in ``prime run``: the
    inference server's ``api_key_var`` / ``api_key_file`` unless set here)."""
    timeout: float = Field(default=600.0, gt=0)
    """Seconds one request may take."""
    backend: Annotated[str, Selects("inference_backends", skip=("auto",))] = "auto"
    """What serves ``base_url``: its client samples and loads weights. ``auto``: the available
    backend with the highest priority (in ``prime run``: ``inference.backend`` when set)."""
    health_timeout: float = Field(default=600.0, gt=0)
    """Seconds to wait for the servers to become healthy at start-up."""
    router: Annotated[str, Selects("routers")] = "round_robin"
    """Which replica each request goes to: ``round_robin``, ``least_outstanding``,
    ``consistent_hash`` (a rollout's turns on one replica), or a router plugin's."""
    admin_base_url: list[str] | None = Field(default=None, min_length=1)
    """One URL per inference engine for weight updates and health checks, when ``base_url`` is
    a router in front of them (admin calls bypass the router); unset: ``base_url``. A single
    string is accepted."""
    on_replica_failure: Literal["continue", "stop"] = "continue"
    """When a replica stops answering its health check: ``continue`` with the others (the
    orchestrator says so in its log, the metrics count the replicas up; with none left the run
    stops), or ``stop`` the run naming it. In ``prime run`` the launcher follows this too: a
    replica's process that dies ends the run only with ``stop``."""
    max_retries: int = Field(default=4, ge=0)
    """Tries after a failed request, each on another replica when one is up (behind a single
    URL, a router: the same URL after a pause of 1, 2, 4, 8 s, while it notices the dead
    engine); then the run stops with the error."""
    health_interval: float = Field(default=5.0, gt=0)
    """Seconds between health checks of every engine while the run goes on (one found down is
    checked again, and takes the current weights before it serves again)."""

    @model_validator(mode="before")
    @classmethod
    def _one_url(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in ("base_url", "admin_base_url"):
                if isinstance(data.get(key), str):
                    data = {**data, key: [data[key]]}
        return data


class SamplingConfig(Section):
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1,
                                   validation_alias=AliasChoices("max_tokens", "max_completion_tokens"))
    """Most tokens per completion; unset = up to ``seq_len``."""
    seed: int | None = None


class EnvConfig(Section):
    """One environment (tasks + rubric) to train on."""

    id: Annotated[str, Selects("environments")]
    """An environment provided by a plugin (``prime plugins list``)."""
    name: str | None = None
    """Label used in metrics; defaults to ``id``."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the environment's loader."""


class RolloutConfig(Section):
    """Limits and tools of every episode (training and eval)."""

    max_turns: int = Field(default=8, ge=1)
    """Model turns per episode (a single-turn environment stops after one anyway)."""
    max_tokens: int | None = Field(default=None, ge=1)
    """Token budget of one rollout: the policy's context (prompt, every turn so far and the
    next one) never grows past it; unset = ``seq_len``."""
    tool_timeout: float = Field(default=30.0, gt=0)
    """Seconds one tool call may take; a slower one is answered with an error turn."""
    tool_parser: Annotated[str, Selects("tool_parsers")] = "hermes"
    """How tool calls are read from the model's text (a ``prime_tool_parsers`` plugin)."""
    max_failed_groups: int = Field(default=50, ge=1)
    """Groups in a row whose rollouts raised before the orchestrator gives up (a broken
    environment fails every rollout; a flaky one only some, which are dropped and counted)."""


class EvalConfig(Section):
    """Evaluation on a fixed set of examples, at step 0 and every ``interval`` steps."""

    interval: int = Field(default=100, ge=1)
    """Evaluate the policy of every step that is a multiple of this (and the first)."""
    env: list[EnvConfig] = Field(default_factory=list)
    """The environments to evaluate; empty: those of ``orchestrator.env``."""
    num_examples: int = Field(default=32, ge=1)
    """Examples per environment: the first ``num_examples`` tasks drawn with ``seed``."""
    rollouts_per_example: int = Field(default=4, ge=1, validation_alias=AliasChoices("rollouts_per_example", "k"))
    """Rollouts per example (k of pass@k and avg@k)."""
    seed: int = 1234
    temperature: float | None = Field(default=None, ge=0)
    """Sampling temperature of eval rollouts; unset: ``sampling.temperature``."""
    max_concurrent: int = Field(default=32, ge=1)
    """Eval rollouts in flight at once, so that training's requests keep getting served."""


class AdvantageConfig(Section):
    type: Annotated[str, Selects("algorithms", prefix="advantage:")] = "grpo"


class OrchestratorConfig(Section):
    """The orchestrator role: samples, scores and packs batches for the trainer."""

    output_dir: Path = Path("outputs")
    model: TokenizerRef = Field(default_factory=TokenizerRef)
    client: ClientConfig = Field(default_factory=ClientConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    env: list[EnvConfig] = Field(default_factory=list)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    eval: EvalConfig | None = None
    """``[orchestrator.eval]``: evaluate at step 0 and every ``interval`` steps."""
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    batch_size: int = Field(default=128, ge=1)
    """Samples per training step."""
    rollouts_per_example: int = Field(default=8, ge=1,
                                      validation_alias=AliasChoices("rollouts_per_example", "group_size"))
    """Completions sampled per prompt (a GRPO group); ``group_size`` is accepted too."""
    max_off_policy_steps: int = Field(default=8, ge=0)
    """Samples from a policy older than this many steps are dropped."""
    async_level: int = Field(default=1, ge=0)
    """How many steps the orchestrator may run ahead of the trainer: the batch of step N is
    only handed over once the policy of step N-1-async_level is loaded for inference."""
    resume: bool = False
    """Continue after the newest complete trainer checkpoint."""
    weights_timeout: float | None = Field(default=3600.0, gt=0)
    """Seconds to wait for the trainer's next policy when nothing else can be done (the
    ``async_level`` bound); then the run stops, naming the weights it waited for. ``None``: wait
    for ever."""
    seq_len: int = Field(default=2048, ge=1)
    max_steps: int | None = Field(default=None, ge=1)
    seed: int = 0
    ckpt: CkptConfig = Field(default_factory=CkptConfig)
    weight_broadcast: WeightBroadcastConfig = Field(default_factory=WeightBroadcastConfig)
    monitors: Monitors = Field(default_factory=lambda: ["jsonl"])
    """Metric sinks (``prime plugins list``); ``jsonl`` is always written."""
    log: LogConfig = Field(default_factory=LogConfig)

    @model_validator(mode="after")
    def _groups_fit(self) -> OrchestratorConfig:
        if self.batch_size % self.rollouts_per_example:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of rollouts_per_example "
                f"({self.rollouts_per_example}): a batch holds whole groups"
            )
        return self
