"""``[inference.router]`` (prime-rl's table): vllm-router in front of the inference replicas.

Its presence starts the router; the orchestrator then sends its requests to the router and its
weight updates and health checks straight to each engine (``orchestrator.client.base_url`` /
``admin_base_url``, set here unless you set them yourself).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from prime_core.config.base import NoSecrets, Section

POLICIES = ("consistent_hash", "cache_aware", "power_of_two", "round_robin", "random", "sticky_least_loaded")
"""vllm-router's ``--policy`` values that work with plain engine URLs (``kv_aware`` needs the
engines' KV events: ``args``)."""


class VLLMRouterConfig(Section):
    """vllm-router (PyPI ``vllm-router``, a Rust router) as its own process in front of the replicas."""

    type: Literal["vllm-router"] = "vllm-router"
    """Which router (prime-rl's key); this plugin runs vllm-router."""
    policy: Literal[POLICIES] = "consistent_hash"  # type: ignore[valid-type]
    """How it picks an engine per request: ``consistent_hash`` keeps the requests of one session
    (the ``X-Session-ID`` header: the turns of one rollout) on one engine; ``cache_aware`` picks
    by prompt prefix and load; ``power_of_two`` the less loaded of two engines at random;
    ``round_robin``, ``random``; ``sticky_least_loaded`` a new session to the least loaded engine
    and its later requests to the same one."""
    host: str = "127.0.0.1"
    """Bind address of the router (and its metrics)."""
    port: int | None = Field(default=None, ge=1, le=65535)
    """Where the orchestrator reaches it; unset: the port after the replicas'
    (``server.port + parallel.dp``)."""
    metrics_port: int | None = Field(default=None, ge=1, le=65535)
    """Its Prometheus metrics (requests per engine: ``vllm_router_processed_requests_total``);
    unset: ``port + 1``."""
    health_check_interval: int = Field(default=2, ge=1)
    """Seconds between its health checks of each engine (vllm-router's own default, 60, leaves a
    dead engine in the rotation for minutes)."""
    health_failure_threshold: int = Field(default=2, ge=1)
    """Failed checks in a row before an engine is out."""
    log_level: Literal["debug", "info", "warning", "error"] = "warning"
    """Its log (``output_dir/logs/vllm-router.log``); ``info`` logs a line or more per request."""
    args: Annotated[dict[str, Any], NoSecrets] = Field(default_factory=dict)
    """Extra vllm-router flags, passed through (``{retry_max_retries = 3}``: ``--retry-max-retries 3``)."""

    @model_validator(mode="after")
    def _ports_differ(self) -> VLLMRouterConfig:
        if self.port is not None and self.metrics_port == self.port:
            raise ValueError(f"metrics_port = port = {self.port}: the router and its metrics need a port each")
        return self


class RouterInFront(Section):
    """Merged into the RL config: with ``[inference.router]``, the orchestrator's requests go to
    the router and its admin calls to each engine."""

    @model_validator(mode="after")
    def _vllm_router_in_front(self) -> Any:
        inference = getattr(self, "inference", None)
        router = getattr(inference, "router", None)
        client = self.orchestrator.client
        if router is None:
            return self
        from prime_plugin_vllm_router.process import engine_urls, router_url

        engines = [f"{url}/v1" for url in engine_urls(inference)]
        # Pointed at the replicas by the core (or by hand, the same URLs): the router goes between.
        if client.base_url == engines and client.admin_base_url is None:
            client.base_url, client.admin_base_url = [router_url(inference)], engines
        return self
