"""Hooks of prime-plugin-transformers: the ``transformers`` inference backend.

transformers' continuous batching (``ContinuousBatchingManager``, paged attention) behind a
small HTTP server in the ``inference`` role's process, with live weight updates, and the client
the orchestrator samples through; and the ``ipc`` weight transport, which only this backend
receives (``shared_weights``). Its ``priority`` (5) is below vLLM's (10): ``auto`` takes it
where vLLM is not installed. Importing this module is cheap: torch and transformers are
imported only by the server and the client.
"""

from __future__ import annotations

from prime_core import hookimpl
from prime_core.specs import InferenceBackend, WeightTransport

PRIME_PLUGIN_API = 1
OLDEST = (5, 17)
"""The oldest transformers whose continuous-batching API this plugin is written against."""


def available() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("transformers")
    except PackageNotFoundError:
        return "transformers is not installed: pip install 'transformers>=5.17'"
    try:
        major, minor = (int(part) for part in installed.split(".")[:2])
    except ValueError:
        return None  # a development build: let it try
    if (major, minor) < OLDEST:
        return f"transformers {installed} is older than 5.17, the first with the continuous batching this uses: " \
               "pip install 'transformers>=5.17'"
    return None


@hookimpl
def prime_inference_backends():
    return [InferenceBackend(
        name="transformers", server="prime_plugin_transformers.server:TransformersServer",
        client="prime_plugin_transformers.client:TransformersClient", available=available,
        priority=5,  # below vLLM's 10: `auto` takes vLLM where it is installed, this one elsewhere
        description="transformers' continuous batching (paged attention) with live weight updates; no vLLM needed",
    )]


@hookimpl
def prime_weight_transports():
    return [WeightTransport(
        name="ipc", publisher="prime_plugin_transformers.shared_weights:SharedPublisher",
        loader="prime_core.weights:FilesystemLoader", device_tensors=True, backends=("transformers",),
        description="trainer and transformers servers on one machine share each version's memory (CUDA IPC on a "
                    "GPU both see, a mapped file on CPUs): no disk, copied device to device",
    )]


@hookimpl
def prime_validate_config(config, root):
    from prime_plugin_transformers.validate import problems

    return problems(config, root)
