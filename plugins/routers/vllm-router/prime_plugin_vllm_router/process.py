"""vllm-router's command line, from the inference config, and the process the launcher starts.

The launcher starts ``prime vllm-router output_dir/configs/inference.json`` (``cli.py``) as the
service role ``vllm-router``, which becomes vllm-router's own launcher (``python -m
vllm_router.launch_router``, what its ``vllm-router`` console script runs): its own process
group, its output in ``output_dir/logs/vllm-router.log``, tied to the launcher like every role
(the kernel SIGTERMs it when the launcher dies; on SIGTERM it shuts down gracefully), stopped
with the run. It waits for every engine to answer its
``/health`` (up to ``inference.startup_timeout``) before it listens, then checks them every
``health_check_interval`` seconds and leaves an engine that fails out of the rotation.
"""

from __future__ import annotations

import sys
from pathlib import Path

from prime_core.launch.plan import cli_flags

MODULE = "vllm_router.launch_router"
LOG_NAME = "vllm-router.log"
ROLE = "vllm-router"


def router_port(inference) -> int:
    return inference.router.port or inference.server.port + inference.parallel.dp


def metrics_port(inference) -> int:
    return inference.router.metrics_port or router_port(inference) + 1


def engine_urls(inference) -> list[str]:
    """Each replica's root URL (``http://127.0.0.1:PORT``), as the router reaches it."""
    from prime_core.inference.replicas import local_url

    host, port = inference.server.host, inference.server.port
    return [local_url(host, port + i).removesuffix("/v1") for i in range(inference.parallel.dp)]


def router_url(inference) -> str:
    """The OpenAI API root the orchestrator samples through."""
    from prime_core.inference.replicas import local_url

    return local_url(inference.router.host, router_port(inference))


def command(inference) -> list[str]:
    router = inference.router
    options = {
        "host": router.host,
        "port": router_port(inference),
        "worker_urls": engine_urls(inference),
        "policy": router.policy,
        # Always our own port: vllm-router binds 29000 when none is given, which two runs share.
        "prometheus_host": router.host,
        "prometheus_port": metrics_port(inference),
        "worker_startup_timeout_secs": int(inference.startup_timeout),
        "worker_startup_check_interval": 2,  # its default, 30 s, holds the run that long after vLLM is up
        "health_check_interval_secs": router.health_check_interval,
        "health_failure_threshold": router.health_failure_threshold,
        "log_level": router.log_level,
    }
    options.update({key.replace("-", "_"): value for key, value in router.args.items()})
    return [sys.executable, "-m", MODULE, *cli_flags(options)]


def service(config, root: str, configs: dict[str, Path]):
    """The launch plan's process for the router of ``config`` (``None`` without one)."""
    from prime_core.launch.plan import RoleProcess, python_command

    inference = config if root == "inference" else getattr(config, "inference", None)
    if getattr(inference, "router", None) is None or "inference" not in configs:
        return None
    return RoleProcess(role=ROLE, command=[*python_command(), "-m", "prime_core", ROLE, str(configs["inference"])],
                       config=configs["inference"], log=Path(config.output_dir) / "logs" / LOG_NAME, service=True,
                       port=router_port(inference))
