"""Config of the inference role (``prime inference``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from prime_core.config.base import ExistingFile, NoSecrets, Noted, Section, Selects, Toggle
from prime_core.config.shared import LogConfig, ModelRef
from prime_core.launch.config import InferenceDeployment, InferenceSingleNodeDeployment, infer_deployment_type


class ApiKeyRef(Section):
    """Where an API key is read from: never the key itself, which would then sit in the written
    configs, logs and process arguments."""

    api_key_var: str = "VLLM_API_KEY"
    """Environment variable holding the API key; unset or empty: no key."""
    api_key_file: ExistingFile | None = None
    """A file whose first line is the API key (wins over ``api_key_var``)."""

    def api_key(self) -> str | None:
        """The key, or ``None`` when none is configured."""
        if self.api_key_file is not None:
            try:
                key = Path(self.api_key_file).read_text(encoding="utf-8").strip().splitlines()
            except OSError as exc:
                from prime_core.errors import PrimeError

                raise PrimeError(f"api_key_file = {self.api_key_file}: cannot read it ({exc.strerror or exc})",
                                 hint="make it readable by this user, or use api_key_var") from None
            return key[0].strip() if key and key[0].strip() else None
        return os.environ.get(self.api_key_var) or None


class ServerConfig(ApiKeyRef):
    """Where the server listens, and the API key every request to it must carry (when one is
    configured: every endpoint, the admin ones and ``/health`` included)."""

    host: str = "127.0.0.1"
    """Bind address; loopback unless you serve other machines on purpose."""
    port: int = Field(default=8000, ge=1, le=65535)


class InferenceParallelConfig(Section):
    tp: int = Field(default=1, ge=1)
    """Tensor-parallel size of one replica."""
    dp: int = Field(default=1, ge=1)
    """Data-parallel replicas: independent servers of ``tp`` GPUs each, one ``prime inference``
    process per replica on consecutive ports from ``server.port`` (the orchestrator gets every
    URL)."""


class InferenceModelConfig(ModelRef):
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    max_model_len: int | None = Field(default=None, ge=1)


class InferenceLoRAConfig(Section):
    """Serve LoRA adapters (set for you when ``trainer.model.lora`` is on in an RL run)."""

    max_rank: int = Field(default=16, ge=1)
    """Largest adapter rank served (rounded up to a rank the backend supports)."""
    max_loras: int = Field(default=1, ge=1)
    """Adapters in one batch."""


class InferenceConfig(Section):
    """The inference role: an OpenAI-compatible server with weight-update endpoints."""

    backend: Annotated[str, Selects("inference_backends", skip=("auto",))] = "auto"
    """An inference-backend plugin (``prime plugins list``); ``auto``: the available one with the
    highest priority."""
    output_dir: Path = Path("outputs")
    model: InferenceModelConfig = Field(default_factory=InferenceModelConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    parallel: InferenceParallelConfig = Field(default_factory=InferenceParallelConfig)
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    lora: Toggle[InferenceLoRAConfig] = None
    deployment: Annotated[InferenceDeployment, infer_deployment_type] = Field(
        default_factory=InferenceSingleNodeDeployment
    )
    startup_timeout: float = Field(default=600.0, gt=0)
    """Seconds to wait for the server to become healthy before giving up."""
    args: Annotated[dict[str, Any], NoSecrets] = Field(default_factory=dict)
    """Extra server arguments passed through unchanged (any vLLM flag, e.g. ``max_num_seqs``)."""
    env: Annotated[dict[str, str], NoSecrets] = Field(default_factory=dict)
    """Extra environment variables for the server process."""
    log: LogConfig = Field(default_factory=LogConfig)
    launcher: str = "auto"
    """``prime inference`` alone: the launcher plugin (``local``, ``slurm``); unused inside ``prime run``."""
    dry_run: bool = False
    """``prime inference`` alone: write the resolved config and the plan, start nothing."""
    weight_broadcast: Annotated[dict[str, Any] | None, Noted(
        "the inference servers load what the trainer's weight_broadcast publishes")] = None

    @model_validator(mode="after")
    def _ports_fit(self) -> InferenceConfig:
        last = self.server.port + self.parallel.dp - 1
        if last > 65535:
            raise ValueError(f"server.port {self.server.port} + parallel.dp {self.parallel.dp} replicas need ports up "
                             f"to {last}, above 65535: lower server.port")
        return self
