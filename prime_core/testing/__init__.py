"""pytest fixtures for testing prime plugins (and prime itself).

Opt in from a test module or ``conftest.py``::

    pytest_plugins = ["prime_core.testing"]

Fixtures:

- ``plugin_manager``: a fresh ``PluginManager`` holding only the core's built-in plugin (no
  entry points loaded), installed as the process-wide manager for the test.
- ``installed_plugins``: a manager that loads every installed plugin for real (entry points),
  installed as the process-wide manager for the test: for tests of configs that use keys
  or names several plugins provide.
- ``register_plugin(obj, name=None)``: register a plugin object (a module or an instance
  with ``@hookimpl`` methods) in that manager; unregistered after the test.
- ``fake_distribution(dist, entry_points=..., files=..., version=...)``: make an installed
  distribution without pip (a ``.dist-info`` folder and its modules on ``sys.path``), so
  entry-point discovery, versions and import failures are tested for real. Returns a
  function that builds a fresh, autoloading manager: ``fake_distribution(...)`` then
  ``discover()``.
- ``prime_cli(*args, env=None)``: run the ``prime`` CLI in-process against the test's
  manager; returns click's ``Result`` (``exit_code``, ``output``, ``stdout``, ``stderr``).

End-to-end helpers: ``records(out, role)`` reads a run's ``metrics.jsonl`` (also while it is
written); ``inference_server(...)`` is one shared ``prime inference``.

Helpers: ``config_only_model(folder, **config)`` writes a model folder that passes the
config's model-folder checks (``config.json`` from ``config``, a weights file with no tensors,
a tokenizer) for tests of what a config or plugin reads from ``config.json``.

``prime_core.testing.ranks.launch(processes, target, argv, timeout=...)``: a script or
``module:main`` in N gloo ranks, forked with torch and transformers already imported where
no GPU is visible (torchrun elsewhere): what the parity and contract runs use.

``prime_core.testing.compiled.python_calls(function, run)``: who called ``function``'s Python
code while ``run()`` ran; code inside a compiled graph never does (tests that blocks stay compiled).

Contract suites, one per plugin kind, live in ``prime_core.testing.contracts`` (imported only
by the tests that use them): subclass ``EnvironmentContract``, ``KernelContract``, ... in a
plugin's ``tests/test_contract.py`` and pytest runs the kind's documented contract against it.

PYTEST_DONT_REWRITE: a test module importing a suite imports this package before pytest loads
it as a plugin, too late for assertion rewriting, which it does not need (it asserts nothing).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from prime_core import ENTRY_POINT_GROUP
from prime_core.plugins import CONTROL_ENV, PluginManager, set_plugin_manager
from prime_core.ports import free_ports  # noqa: F401 - the tests import it from here


def records(out: Path, role: str) -> list[dict]:
    """``role``'s records in the ``metrics.jsonl`` of run folder ``out`` (``[]`` before there is
    one); a line still being written is skipped, so a test may poll a running run's file."""
    from prime_core.metrics import read_jsonl

    return [r for r in read_jsonl(out / "metrics.jsonl") if r.get("role") == role]


@contextlib.contextmanager
def inference_server(model, out: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 360):
    """``prime inference`` on ``model`` (extra CLI ``args``), logging to ``out/inference.out``;
    yields its ``/v1`` URL once ready, and stops it (and vLLM's process group) on exit. For
    tests whose runs share one server (``--no-inference``)."""
    import os
    import subprocess
    import time

    port = free_ports(1)
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "prime_core", "inference", "--model.name", str(model), *args,
               "--server.port", str(port), "--output-dir", str(out), "--startup-timeout", str(int(timeout) - 60)]
    log_path = out / "inference.out"
    with log_path.open("w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
        try:
            deadline = time.monotonic() + timeout
            while "inference ready at" not in log_path.read_text():
                assert proc.poll() is None, log_path.read_text()
                assert time.monotonic() < deadline, "the inference server did not start"
                time.sleep(0.5)
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            proc.terminate()  # the role stops its server (and vLLM's process group) on SIGTERM
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()


def fresh_manager(*, autoload: bool = False) -> PluginManager:
    import prime_core.builtin

    manager = PluginManager(autoload=autoload, disabled=())
    if not autoload:
        manager.load()
        manager.register(prime_core.builtin, name="core", dist="prime-core", check_api=True)
    return manager.load()


def config_only_model(folder: Path, **config) -> Path:
    """A model folder holding ``config.json`` (``config``), a safetensors file with no tensors
    and a byte-level tokenizer: enough for config checks, not to load a model."""
    import json

    from prime_core.testing.chat import chat_tokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")
    chat_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture
def plugin_manager(monkeypatch) -> PluginManager:
    for name in CONTROL_ENV:
        monkeypatch.delenv(name, raising=False)
    manager = fresh_manager()
    set_plugin_manager(manager)
    yield manager
    set_plugin_manager(None)


@pytest.fixture
def installed_plugins(plugin_manager) -> PluginManager:
    manager = PluginManager(autoload=True, disabled=()).load()
    set_plugin_manager(manager)
    yield manager
    set_plugin_manager(plugin_manager)


@pytest.fixture
def register_plugin(plugin_manager) -> Callable:
    added: list[str] = []

    def register(obj, name: str | None = None, **kwargs):
        record = plugin_manager.register(obj, name=name, **kwargs)
        added.append(record.name)
        plugin_manager.__dict__.pop("_schemas", None)
        return record

    yield register
    for name in added:
        plugin_manager.unregister(name)


@pytest.fixture
def fake_distribution(tmp_path, monkeypatch) -> Callable:
    site = tmp_path / "fake-site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    modules: list[str] = []

    def make(dist: str, *, entry_points: dict[str, str] | None = None, files: dict[str, str] | None = None,
             version: str = "1.0.0", group: str = ENTRY_POINT_GROUP) -> Callable[[], PluginManager]:
        normalized = dist.replace("-", "_")
        info = site / f"{normalized}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        lines = [f"[{group}]"] + [f"{k} = {v}" for k, v in (entry_points or {}).items()]
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        for relative, text in (files or {}).items():
            path = site / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            modules.append(Path(relative).with_suffix("").as_posix().replace("/", "."))
        importlib.invalidate_caches()
        return discover

    def discover() -> PluginManager:
        manager = PluginManager(autoload=True, disabled=None)
        set_plugin_manager(manager)
        return manager.load()

    for name in CONTROL_ENV:
        monkeypatch.delenv(name, raising=False)
    yield make
    set_plugin_manager(None)
    for name in modules:
        for key in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:
            del sys.modules[key]
    importlib.invalidate_caches()


@pytest.fixture
def prime_cli(monkeypatch) -> Callable:
    from click.testing import CliRunner
    from typer.main import get_command

    from prime_core.cli.app import build_app
    from prime_core.plugins import get_plugin_manager

    def invoke(*args: str, env: dict[str, str] | None = None):
        manager = get_plugin_manager()
        command = get_command(build_app(manager))
        return CliRunner().invoke(command, list(args), env=env, prog_name="prime")

    return invoke


def pytest_configure(config) -> None:
    """Tests run offline unless the environment says otherwise, as prime's roles do: the Hub
    client reads ``HF_HUB_OFFLINE`` once, when first imported, and online, a lookup of a name
    that is not local waits some 20 s for a network these machines may not have."""
    from prime_core.hub import default_offline

    default_offline()


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked ``gpu`` skip, with the reason, where no CUDA device is visible."""
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible here)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
