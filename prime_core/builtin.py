"""The core's built-in plugin: defaults that need no extra dependency, registered through the
same hooks and entry-point group as any third-party plugin (name ``core``)."""

from __future__ import annotations

import time
from pathlib import Path

from prime_core import hookimpl
from prime_core.specs import Algorithm, Monitor, Router, ToolParser, WeightTransport

PRIME_PLUGIN_API = 1


class JsonlMonitor:
    """Appends one JSON object per step to ``<output_dir>/metrics.jsonl``.

    Each line is written under a lock, flushed and fsynced, so roles sharing the file never
    interleave and a crash loses at most the step being written.
    """

    def __init__(self, config=None, *, output_dir: str | Path, role: str) -> None:
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.role = role

    def log(self, metrics: dict, step: int) -> None:
        from prime_core.metrics import append_jsonl

        append_jsonl(self.path, {"step": step, "role": self.role, "time": time.time(), **metrics})

    def close(self) -> None:
        pass


@hookimpl
def prime_monitors():
    return [Monitor(name="jsonl", make=JsonlMonitor, description="metrics.jsonl under output_dir")]


@hookimpl
def prime_routers():
    return [
        Router(name="round_robin", make="prime_core.routers:RoundRobin",
               description="each request to the next replica"),
        Router(name="least_outstanding", make="prime_core.routers:LeastOutstanding",
               description="each request to the replica with the fewest requests in flight"),
        Router(name="consistent_hash", make="prime_core.routers:ConsistentHash", aliases=("sticky",),
               description="a session's requests to one replica (hash ring; the next one when it is down)"),
    ]


def _auto_backends(config, root: str):
    """The key of every ``backend = "auto"`` in a config. ``auto`` is resolved when a role
    starts; checking it here stops a run that would fail there before anything starts."""
    sections = {"rl": (("inference", getattr(config, "inference", None)),
                       ("orchestrator.client", getattr(getattr(config, "orchestrator", None), "client", None))),
                "inference": (("", config),),
                "orchestrator": (("client", getattr(config, "client", None)),)}.get(root, ())
    for prefix, section in sections:
        if section is not None and getattr(section, "backend", None) == "auto":
            yield f"{prefix}.backend" if prefix else "backend"


@hookimpl
def prime_validate_config(config, root):
    from prime_core.errors import PluginError
    from prime_core.inference.backend import select_backend

    for key in _auto_backends(config, root):
        try:
            select_backend("auto", key=key)
        except PluginError as exc:
            yield str(exc)
            return  # one message is enough: every key fails the same way
    yield from _transport_problems(config, root)


def _transport_problems(config, root: str):
    """A weight transport whose versions only some backends read, with another backend."""
    from prime_core.errors import PluginError
    from prime_core.inference.backend import select_backend
    from prime_core.plugins import get_plugin_manager

    inference = getattr(config, "inference", None) if root == "rl" else None
    broadcast = getattr(getattr(config, "orchestrator", None), "weight_broadcast", None)
    if inference is None or broadcast is None:
        return
    manager = get_plugin_manager()
    try:
        transport = manager.select("weight_transports", broadcast.type, key="weight_broadcast.type")
        backend = select_backend(inference.backend, key="inference.backend", manager=manager)
    except PluginError:
        return  # an unknown or unavailable name: reported with its key by the name checks
    if transport.backends and backend.name not in transport.backends:
        names = " or ".join(repr(b) for b in transport.backends)
        chosen = repr(inference.backend) + (f" (here: {backend.name!r})" if inference.backend == "auto" else "")
        yield (f"weight_broadcast.type = {broadcast.type!r} is read by the {names} inference backend(s) only, and "
               f"inference.backend is {chosen}: set inference.backend to one of them, or use "
               "weight_broadcast.type = 'filesystem'")


@hookimpl
def prime_tool_parsers():
    return [ToolParser(name="hermes", parse="prime_core.orchestrator.hermes:parse",
                       format="prime_core.orchestrator.hermes:format_calls",
                       description="Hermes / Qwen3 <tool_call>{json}</tool_call>")]


@hookimpl
def prime_weight_transports():
    return [WeightTransport(name="filesystem", publisher="prime_core.weights:FilesystemPublisher",
                            loader="prime_core.weights:FilesystemLoader",
                            description="safetensors under output_dir/weights/step_N with a STABLE marker",
                            publishes_in_background=True)]


@hookimpl
def prime_algorithms():
    return [
        Algorithm(name="grpo", kind="advantage", fn="prime_core.algorithms:grpo_advantages",
                  description="r - mean(r) within each group"),
        Algorithm(name="default", kind="loss", fn="prime_core.algorithms:default_loss",
                  description="importance ratio vs inference logprobs, probability-difference masking, KL term "
                              "(with teacher logprobs: teacher_tau x the teacher's log-ratio in the advantage)"),
        Algorithm(name="sft", kind="loss", fn="prime_core.algorithms:sft_loss",
                  description="negative log-likelihood of the sampled tokens (hard distillation)"),
    ]
