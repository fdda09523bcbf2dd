"""Hooks of prime-plugin-vllm-router: ``[inference.router]`` starts vllm-router in front of the
inference replicas.

- ``prime_config_sections``: the ``inference.router`` table (``router`` in a ``prime
  inference`` config), and, merged into the RL config, what points the orchestrator at the
  router (requests) and at each engine (weight updates, health: ``admin_base_url``).
- ``prime_services``: the router process the launcher starts after the replicas,
  ``prime vllm-router output_dir/configs/inference.json`` (``prime_cli_commands``).
- ``prime_validate_config``: what would fail only once the run is up.

Importing this module is cheap: vllm-router itself runs in its own process.
"""

from __future__ import annotations

from prime_core import hookimpl
from prime_core.specs import CliCommand, ConfigSection

PRIME_PLUGIN_API = 1


@hookimpl
def prime_config_sections():
    return [
        ConfigSection(name="inference.router", model="prime_plugin_vllm_router.config:VLLMRouterConfig",
                      roots=("rl",), description="vllm-router in front of the inference replicas"),
        ConfigSection(name="", merge=True, model="prime_plugin_vllm_router.config:RouterInFront", roots=("rl",)),
    ]


@hookimpl
def prime_cli_commands():
    return [CliCommand(name="vllm-router", app="prime_plugin_vllm_router.cli:vllm_router",
                       description="Run vllm-router in front of the replicas of a resolved inference config.")]


@hookimpl
def prime_services(config, root, configs):
    from prime_plugin_vllm_router.process import service

    process = service(config, root, configs)
    return [process] if process is not None else []


def _problems(inference, prefix: str):
    from prime_plugin_vllm_router.process import metrics_port, router_port

    if inference.server.api_key():
        key = inference.server.api_key_file or inference.server.api_key_var
        yield (f"{prefix}router: vllm-router checks no API key on its own endpoints, yet would forward every "
               f"request (weight loads through /collective_rpc included) to servers that require the key set by "
               f"{prefix}server ({key}); leave out {prefix}router while a key is set (the orchestrator's "
               "client-side routers keep every endpoint behind the key: orchestrator.client.router = "
               "'consistent_hash'), or unset the key")
    first, last = inference.server.port, inference.server.port + inference.parallel.dp - 1
    for name, port in (("port", router_port(inference)), ("metrics_port", metrics_port(inference))):
        if first <= port <= last:
            yield (f"{prefix}router.{name} = {port} is a replica's port ({prefix}server.port {first} to {last} for "
                   f"{inference.parallel.dp} replica(s)): choose another")
        elif port > 65535:
            yield f"{prefix}router.{name} would be {port}, above 65535: set it, or lower {prefix}server.port"


@hookimpl
def prime_validate_config(config, root):
    inference = config if root == "inference" else getattr(config, "inference", None) if root == "rl" else None
    if getattr(inference, "router", None) is None:
        return []
    return list(_problems(inference, "" if root == "inference" else "inference."))
