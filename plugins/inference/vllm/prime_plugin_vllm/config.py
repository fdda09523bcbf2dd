"""The vllm plugin's keys of the ``inference`` config, by prime-rl's names (0.5 and 0.6).

Each key is one vLLM server option (``--enable-prefix-caching`` for ``enable_prefix_caching``),
passed on when it is set. Keys that tune parts prime does its own way are accepted and named in
one warning line (``Noted``): prime runs ``inference.parallel.dp`` replicas as separate servers,
so vLLM's own data-parallel keys have nothing to act on.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import Field, field_validator, model_validator

from prime_core.config.base import Noted, Section

_NODES = ("prime's inference nodes each run their own inference.parallel.dp replicas (deployment.num_nodes): "
          "no vLLM data-parallel group spans nodes")

# (key, vLLM option): passed when set (not None, not False).
PASSED = (("api_server_count", "api_server_count"), ("enable_prefix_caching", "enable_prefix_caching"),
          ("enable_expert_parallel", "enable_expert_parallel"), ("enable_eplb", "enable_eplb"),
          ("enable_dbo", "enable_dbo"), ("enable_return_routed_experts", "enable_return_routed_experts"),
          ("all2all_backend", "all2all_backend"), ("seed", "seed"), ("lora_target_modules", "lora_target_modules"),
          ("max_cpu_loras", "max_cpu_loras"))


class VLLMModelKeys(Section):
    enforce_eager: bool = False
    """Run the model eagerly (no CUDA graphs or compilation): a faster start, slower steps."""
    tool_call_parser: Annotated[str | None, Noted(
        "'auto': prime's orchestrator reads tool calls itself (orchestrator.rollout.tool_parser); vLLM's parser "
        "is started only when named", when=lambda v: v == "auto")] = None
    """vLLM's ``--tool-call-parser`` (with ``--enable-auto-tool-choice``) for clients of the server's
    chat API; prime's own rollouts read tool calls with ``orchestrator.rollout.tool_parser``."""
    reasoning_parser: Annotated[str | None, Noted(
        "'auto': vLLM's reasoning parser is started only when named", when=lambda v: v == "auto")] = None
    """vLLM's ``--reasoning-parser``."""
    rope_scaling: dict[str, Any] | None = None
    """RoPE scaling of the served model (vLLM's ``hf_overrides = {rope_scaling = ...}``), e.g.
    ``{rope_type = "yarn", factor = 4.0, original_max_position_embeddings = 32768}``."""

    def vllm_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {}
        if self.tool_call_parser not in (None, "auto"):
            options.update(tool_call_parser=self.tool_call_parser, enable_auto_tool_choice=True)
        if self.reasoning_parser not in (None, "auto"):
            options["reasoning_parser"] = self.reasoning_parser
        if self.rope_scaling is not None:
            options["hf_overrides"] = {"rope_scaling": self.rope_scaling}
        return options


class VLLMServerKeys(Section):
    liveness_timeout_seconds: Annotated[float | None, Noted(
        "prime's health check is /health (inference.startup_timeout bounds the start)")] = None


class VLLMKeys(Section):
    prime_rl_keys: ClassVar[tuple[str, ...]] = ("enable_lora", "max_lora_rank", "max_loras", "vllm_extra",
                                                "tensor_parallel_size", "data_parallel_size")

    api_server_count: int | None = None
    """vLLM API server processes of one replica (``--api-server-count``)."""
    enable_prefix_caching: bool | None = None
    """``--enable-prefix-caching`` (``false``: ``--no-enable-prefix-caching``); unset: vLLM's default."""
    enable_expert_parallel: bool = False
    """Expert parallelism for MoE models (``--enable-expert-parallel``)."""
    enable_eplb: bool = False
    """vLLM's expert-parallel load balancer (``--enable-eplb``)."""
    enable_dbo: bool = False
    """Dual batch overlap (``--enable-dbo``)."""
    enable_return_routed_experts: bool = False
    """``--enable-return-routed-experts``."""
    all2all_backend: str | None = None
    """All-to-all backend of expert parallelism (``--all2all-backend``)."""
    seed: int | None = None
    """vLLM's ``--seed``."""
    lora_target_modules: list[str] | None = None
    """Modules LoRA adapters may target (``--lora-target-modules``)."""
    max_cpu_loras: int | None = None
    """Adapters kept in CPU memory (``--max-cpu-loras``); unset: ``lora.max_loras + 2``."""
    use_deep_gemm: bool = False
    """DeepGEMM FP8 kernels (``VLLM_USE_DEEP_GEMM=1`` in the server's environment)."""
    cache_dir: str | None = None
    """Where vLLM and inductor keep compiled graphs and model metadata: ``VLLM_CACHE_ROOT`` is
    ``<cache_dir>/vllm`` and ``TORCHINDUCTOR_CACHE_DIR`` is ``<cache_dir>/inductor``. Unset:
    vLLM's own (the environment's ``VLLM_CACHE_ROOT``, else ``~/.cache/vllm``), shared by every
    run, so a start reuses what earlier ones compiled and inspected (vLLM writes its cache
    atomically and keys it by the code and config that made it)."""

    data_parallel_size_local: Annotated[int | None, Noted(
        "prime runs inference.parallel.dp replicas as separate servers (one per replica)")] = None
    data_parallel_rpc_port: Annotated[int | None, Noted(
        "prime runs inference.parallel.dp replicas as separate servers (one per replica)")] = None
    data_parallel_address: Annotated[str | None, Noted(_NODES)] = None
    data_parallel_start_rank: Annotated[int | None, Noted(_NODES)] = None
    headless: Annotated[bool, Noted(_NODES)] = False
    api_key: str | None = None
    """Refused: a secret in a config is written to disk (``server.api_key_var`` names the
    variable that holds it)."""

    @field_validator("api_key")
    @classmethod
    def _no_key_in_config(cls, value: str | None) -> None:
        if value is not None:
            raise ValueError("the server's API key is not taken from a config or the command line (it would be "
                             "written to output_dir/configs/ and shown by --dry-run): export it and set "
                             "server.api_key_var = 'NAME' (default VLLM_API_KEY) or server.api_key_file")
    enable_fp32_lm_head: Annotated[bool | None, Noted(
        "vLLM computes the LM head in the model's dtype in prime (no fp32 LM-head patch)")] = None
    kv_cache_offload: Annotated[dict[str, Any] | None, Noted(
        "prime starts vLLM without KV-cache offloading; vLLM's own options can go in inference.args")] = None
    use_pd_kv_transfer: Annotated[bool, Noted("prime serves without prefill/decode disaggregation")] = False
    experimental: Annotated[dict[str, Any] | None, Noted("prime has no experimental inference keys")] = None

    @model_validator(mode="before")
    @classmethod
    def _prime_rl_keys(cls, data: Any) -> Any:
        """prime-rl's ``enable_lora`` / ``max_lora_rank`` / ``max_loras`` are prime's ``[inference.lora]``,
        its ``vllm_extra`` is prime's ``args``, and vLLM's ``tensor_parallel_size`` and data-parallel
        size (``data_parallel_size_local`` where given: the replicas of this node) are
        ``parallel.tp`` and ``parallel.dp``."""
        if not isinstance(data, dict):
            return data
        keys = {"enable_lora", "max_lora_rank", "max_loras", "vllm_extra", "tensor_parallel_size",
                "data_parallel_size", "data_parallel_size_local"} & data.keys()
        if not keys:
            return data
        data = dict(data)
        if {"tensor_parallel_size", "data_parallel_size", "data_parallel_size_local"} & keys \
                and isinstance(data.get("parallel", {}), dict):
            parallel = dict(data.get("parallel") or {})
            if "tensor_parallel_size" in data:
                parallel.setdefault("tp", data.pop("tensor_parallel_size"))
            size = data.pop("data_parallel_size", None)
            local = data.get("data_parallel_size_local")
            if local is not None or size is not None:
                parallel.setdefault("dp", local if local is not None else size)
            data["parallel"] = parallel
        enable = data.pop("enable_lora", None)
        lora = {}
        if "max_lora_rank" in data:
            lora["max_rank"] = data.pop("max_lora_rank")
        if "max_loras" in data:
            lora["max_loras"] = data.pop("max_loras")
        current = data.get("lora")
        if enable or (enable is None and lora) or (lora and current):
            current = {} if current in (None, True) else current
            if isinstance(current, dict):
                data["lora"] = {**lora, **current}
        if "vllm_extra" in data:
            extra = data.pop("vllm_extra") or {}
            data["args"] = {**extra, **(data.get("args") or {})}
        return data

    def vllm_options(self) -> dict[str, Any]:
        options = {option: getattr(self, key) for key, option in PASSED
                   if getattr(self, key) is not None and getattr(self, key) is not False}
        if self.enable_prefix_caching is False:
            options["enable_prefix_caching"] = False
        return options


class WeightBroadcastKeys(Section):
    """prime-rl's ``[weight_broadcast]`` keys of the ``nccl`` transport (``broadcast.py``); with
    ``type = "filesystem"`` they have nothing to act on."""

    host: str | None = None
    """The address inference workers reach trainer rank 0 at, and the one its rendezvous listens
    on; ``prime run`` on one machine sets 127.0.0.1; unset (a trainer started alone, several
    machines): its host name, listening on every interface."""
    port: int | None = Field(default=None, ge=0, le=65535)
    """The port of the group's rendezvous on trainer rank 0; unset or 0: a free one. The
    address travels to the servers in ``weights/step_N/BROADCAST.json``."""
    timeout: float | None = Field(default=None, gt=0)
    """Seconds any side waits for another (all receivers to join, the trainer to send, a
    receiver to take a bucket) before the run stops naming the side that did not answer;
    unset: 1200."""
    inference_world_size: int | None = Field(default=None, ge=1)
    """Inference workers that receive the weights (replicas x tensor parallel); ``prime run``
    sets it from ``inference.parallel``."""
    bucket_mb: float | None = Field(default=None, gt=0)
    """Size of one broadcast buffer in MiB (tensors are packed into buffers of about this size);
    unset: 256."""


class BroadcastWorldSize(Section):
    """``prime run``: the receivers of a broadcast are the inference workers it starts."""

    @model_validator(mode="after")
    def _vllm_broadcast_world_size(self):
        inference = getattr(self, "inference", None)
        if inference is None:
            return self
        from prime_core.config.rl import infer_nodes

        workers = inference.parallel.dp * inference.parallel.tp * infer_nodes(self.deployment)
        for owner in (self, self.trainer, self.orchestrator):
            section = getattr(owner, "weight_broadcast", None)
            if section is None or section.type != "nccl":
                continue
            if section.inference_world_size is None:
                section.inference_world_size = workers
            if section.host is None and self.deployment.type == "single_node":
                section.host = "127.0.0.1"  # every role on this machine: nothing listens beyond it
        return self
