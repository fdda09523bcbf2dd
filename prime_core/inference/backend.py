"""Choosing the inference backend (``inference.backend``, ``orchestrator.client.backend``).

``auto`` (the default) takes the backend with the highest ``priority`` among those that can
run here (ties by name, so registration order never decides); any other value is a name,
selected like every registry entry.
"""

from __future__ import annotations

AUTO = "auto"


def select_backend(name: str, *, key: str, manager=None):
    """The ``InferenceBackend`` spec for the config value ``name`` at ``key``; raises
    ``PluginError`` naming the key when none fits."""
    from prime_core.errors import PluginError
    from prime_core.plugins import get_plugin_manager

    manager = manager or get_plugin_manager()
    if name != AUTO:
        return manager.select("inference_backends", name, key=key)
    entries = manager.registry("inference_backends")
    usable = [p.spec for p in entries.values() if p.spec.unavailable_reason() is None]
    if not usable:
        why = "; ".join(f"'{n}': {p.spec.unavailable_reason()}" for n, p in entries.items())
        raise PluginError(
            f"{key} = 'auto': no installed inference backend can run here"
            + (f" ({why})" if why else " (none is installed)"),
            hint="install an inference backend plugin; `prime plugins list` shows what is installed and why "
                 "each cannot run",
        )
    return max(usable, key=lambda spec: (spec.priority, spec.name))


def describe(spec, name: str) -> str:
    """The backend's name, and how it was chosen when the config said ``auto`` (start-up lines)."""
    if name != AUTO:
        return spec.name
    return f"{spec.name} (auto: the available backend with the highest priority)"
