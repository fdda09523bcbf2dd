"""Contract suites: the documented call contract of each plugin kind, checked for real.

Each module holds one kind's suite: a base class that a plugin's ``tests/test_contract.py``
subclasses (pytest then runs every check against the plugin), and the ``check_*`` functions
those tests call, usable on their own. A check calls the plugin the way the core calls it
(same arguments, types, process and thread) and raises ``ContractError`` naming the promise
that was broken.

=================  ==========================================  ========================
kind               module                                      base class
=================  ==========================================  ========================
environment        ``prime_core.testing.contracts.environment``  ``EnvironmentContract``
monitor            ``prime_core.testing.contracts.monitor``      ``MonitorContract``
launcher           ``prime_core.testing.contracts.launcher``     ``LauncherContract``
kernel             ``prime_core.testing.contracts.kernel``       ``KernelContract``
model impl         ``prime_core.testing.contracts.model_impl``   ``ModelImplContract``
weight transport   ``prime_core.testing.contracts.weight_transport``  ``WeightTransportContract``
algorithm          ``prime_core.testing.contracts.algorithm``    ``AlgorithmContract``
=================  ==========================================  ========================

Every base class takes ``name`` (the spec's registry key, e.g. ``"reverse_text"`` or
``"lm_head:fused"``) and ``plugin``: the plugin object or its import path
(``"prime_plugin_x.plugin"``), registered in a fresh manager beside the core's built-in
plugin; ``None`` (the default) tests what is installed, through the entry points.
Expert-parallel backends have their own suite in ``prime_plugin_ep.contract``.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from stat import S_ISREG
from typing import Any, ClassVar

import pytest

from prime_core.plugins import REGISTRIES, PluginManager, set_plugin_manager
from prime_core.specs import Spec


class ContractError(AssertionError):
    """A plugin broke its kind's documented contract."""


def expect(condition: Any, message: str) -> None:
    if not condition:
        raise ContractError(message)


def manager_for(plugin: Any = None) -> PluginManager:
    """The core's built-in plugin plus ``plugin`` (an object, or a module's import path);
    every installed plugin when ``plugin`` is ``None``."""
    from prime_core.testing import fresh_manager

    if plugin is None:
        return PluginManager(autoload=True, disabled=()).load()
    if isinstance(plugin, str):
        plugin = importlib.import_module(plugin)
    manager = fresh_manager()
    if manager.pm.is_registered(plugin):  # the core's built-in plugin is in every manager
        return manager
    name = getattr(plugin, "__name__", type(plugin).__name__).split(".")[0].removeprefix("prime_plugin_")
    manager.register(plugin, name=name, check_api=True)
    return manager


def spec_from(manager: PluginManager, registry: str, key: str) -> Spec:
    """The spec registered under ``key``, available here or not (the suites decide what an
    unavailable spec must still do)."""
    entries = manager.registry(registry)
    noun = REGISTRIES[registry].noun
    expect(key in entries, f"no {noun} named '{key}' is registered (registered: {', '.join(entries) or 'none'})")
    spec = entries[key].spec
    expect(isinstance(spec, REGISTRIES[registry].spec),
           f"{noun} '{key}' is a {type(spec).__name__}, not a {REGISTRIES[registry].spec.__name__}")
    return spec


def check_available(spec: Spec) -> str | None:
    """``available()`` answers ``None`` or a non-empty reason, and does not raise."""
    check = spec.available
    if check is None:
        return None
    try:
        reason = check()
    except Exception as exc:
        raise ContractError(f"'{spec.key}': available() raised {type(exc).__name__}: {exc}; "
                            "it must return None or a reason") from exc
    expect(reason is None or (isinstance(reason, str) and reason.strip()),
           f"'{spec.key}': available() returned {reason!r}; it must return None or a non-empty reason")
    return reason


def role_config(root: str, output_dir: Path, *tokens: str):
    """A root's default config (``trainer``, ``orchestrator``, ``sft``, ...) with ``output_dir``,
    loaded through the config system as a role process loads it."""
    from prime_core.cli.common import load_config

    return load_config(root, [*tokens, "--output-dir", str(output_dir)])


class Contract:
    """What every suite shares: the registry, the spec under test and the manager holding it."""

    registry: ClassVar[str] = ""
    name: ClassVar[str] = ""
    """The spec's registry key."""
    plugin: ClassVar[Any] = None
    """The plugin object (or its import path) to test; ``None``: the installed plugins."""

    @pytest.fixture
    def manager(self):
        manager = manager_for(self.plugin)
        set_plugin_manager(manager)
        yield manager
        set_plugin_manager(None)

    @pytest.fixture
    def spec(self, manager):
        if not self.name:
            pytest.fail(f"{type(self).__name__} must set `name` to the spec's registry key")
        return spec_from(manager, self.registry, self.name)

    @pytest.fixture
    def sandbox(self, tmp_path, monkeypatch):
        """A clean working directory, ``HOME`` and temporary directory inside ``tmp_path``, so
        that a check sees every file the plugin writes (``Files(sandbox)``)."""
        import tempfile

        for name in ("cwd", "home", "tmp"):
            (tmp_path / name).mkdir()
        monkeypatch.chdir(tmp_path / "cwd")
        monkeypatch.setenv("HOME", str(tmp_path / "home"))
        monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
        return tmp_path

    def test_available_answers_none_or_a_reason(self, spec):
        check_available(spec)


class Files:
    """The files under ``roots`` now; ``written()`` lists those added or changed since."""

    def __init__(self, *roots: Path) -> None:
        self.roots = [Path(r) for r in roots]
        self.before = self._scan()

    def _scan(self) -> dict[Path, tuple[int, int]]:
        found = {}
        for root in self.roots:
            for folder, _, names in os.walk(root):
                for name in names:
                    path = Path(folder) / name
                    try:
                        stat = path.stat()
                    except OSError:
                        continue
                    if S_ISREG(stat.st_mode):  # files; not a library's unix sockets
                        found[path] = (stat.st_mtime_ns, stat.st_size)
        return found

    def written(self, *, allowed: Path | None = None) -> list[Path]:
        now = self._scan()
        changed = sorted(p for p, stamp in now.items() if self.before.get(p) != stamp)
        if allowed is not None:
            changed = [p for p in changed if not p.is_relative_to(allowed)]
        return changed
