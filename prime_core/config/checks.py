"""Checks of a validated config against what is installed: every name the config selects
(``launcher``, ``orchestrator.env[].id``, ``trainer.loss.type``, ...) and every feature it
turns on (``trainer.model.ep > 1`` needs the ``ep`` strategy) must be provided by an active
plugin that can run here; ``required_plugins`` must be active; and each plugin's
``prime_validate_config`` gets its say. Problems are collected, never raised one by one."""

from __future__ import annotations

import threading
from typing import Any

from pydantic import BaseModel

from prime_core.config.base import Requires, Selects, walk_fields
from prime_core.config.env_args import env_args_problems
from prime_core.config.schema import build_schema
from prime_core.errors import PluginError, did_you_mean
from prime_core.plugins import REGISTRIES, PluginManager, get_plugin_manager

_BUILDING = threading.Lock()
"""One schema build at a time: pydantic parses class sources to read attribute docstrings, and
CPython 3.11's parser is not safe when two threads do that at once (SystemError)."""


def schema_for(root: str, manager: PluginManager | None = None) -> type[BaseModel]:
    """The schema of ``root`` with the sections of the active plugins (cached per manager)."""
    manager = manager or get_plugin_manager()
    cache = manager.__dict__.setdefault("_schemas", {})
    with _BUILDING:
        if root not in cache:
            sections = [(p.spec, p.plugin) for p in manager.registry("config_sections").values()]
            cache[root] = build_schema(root, sections)
    return cache[root]


def section_model(root: str, path: str, manager: PluginManager | None = None) -> type[BaseModel]:
    """The model at dotted ``path`` of ``root``'s schema, with every active plugin's keys
    (``section_model("trainer", "model")``: ``trainer.model`` as plugins extend it)."""
    from prime_core.config.schema import model_at

    model = model_at(schema_for(root, manager), tuple(path.split(".")))
    if model is None:
        raise KeyError(f"{root} config has no section '{path}'")
    return model


def _used(marker: Selects | Requires, section: BaseModel, value: Any) -> bool:
    if marker.when is not None:
        return bool(marker.when(section))
    return value is not None and value is not False


def _marked(model: BaseModel):
    """(dotted key, value, marker) for every marked field in use."""
    for key, value, info, section in walk_fields(model):
        for marker in info.metadata:
            if isinstance(marker, Selects | Requires) and _used(marker, section, value):
                yield key, value, marker


def _check_select(manager: PluginManager, key: str, value: Any, marker: Selects) -> list[str]:
    if marker.each:
        items = [(f"{key}[{i}]", f"{marker.prefix}{item}", item) for i, item in enumerate(value)]
    elif marker.mapping:
        items = [(f"{key}.{op}", f"{op}:{name}", name) for op, name in value.items()]
    else:
        items = [(key, f"{marker.prefix}{value}", value)]
    problems = []
    for where, name, shown in items:
        if shown in marker.skip:
            continue
        try:
            manager.select(marker.registry, name, key=where, shown=str(shown))
        except PluginError as exc:
            problems.append(str(exc))
    return problems


def _check_one(manager: PluginManager, key: str, value: Any, marker: Selects | Requires) -> list[str]:
    if isinstance(marker, Selects):
        return _check_select(manager, key, value, marker)
    problem = _check_requires(manager, key, value, marker)
    return [problem] if problem else []


def _check_requires(manager: PluginManager, key: str, value: Any, marker: Requires) -> str | None:
    entries = manager.registry(marker.registry)
    noun = REGISTRIES[marker.registry].noun
    setting = f"[{key}]" if isinstance(value, BaseModel) else f"{key} = {value!r}"  # a table: just "is on"
    if marker.slot is not None:
        usable = [k for k, p in entries.items()
                  if getattr(p.spec, "slot", None) == marker.slot and p.spec.unavailable_reason() is None]
        return None if usable else (f"{setting} needs a {noun} in the '{marker.slot}' slot of the build order, "
                                    "which no installed plugin provides (`prime plugins list`)")
    if marker.name.endswith("*"):
        matches = [k for k in entries if k.startswith(marker.name[:-1])]
        if any(entries[k].spec.unavailable_reason() is None for k in matches):
            return None
        reasons = "; ".join(f"{k}: {entries[k].spec.unavailable_reason()}" for k in matches)
        return f"{setting} needs {noun} '{marker.name}'" + (
            f", but none can run here ({reasons})" if matches else ", which no installed plugin provides"
        )
    try:
        manager.select(marker.registry, marker.name)
    except PluginError as exc:
        return f"{setting} needs the {noun} '{marker.name}': {exc}"
    return None


def resolve_launcher(config: BaseModel, manager: PluginManager) -> str:
    name = getattr(config, "launcher", "auto")
    if name != "auto":
        return name
    chosen = manager.hook.prime_select_launcher(config=config)
    if not chosen:
        raise PluginError(
            "launcher = 'auto': no installed plugin chose a launcher for this config",
            hint="set `launcher` to one listed by `prime plugins list`, or install a launcher plugin",
        )
    return chosen


def runs_here(config: BaseModel, manager: PluginManager) -> bool:
    """Whether the config's roles run on this machine (its launcher is not ``remote``)."""
    if not hasattr(config, "launcher"):
        return True
    try:
        return not manager.select("launchers", resolve_launcher(config, manager)).remote
    except PluginError:
        return True  # reported by check() itself


def check(config: BaseModel, root: str, manager: PluginManager | None = None, *, here: bool | None = None
          ) -> list[str]:
    """Every problem that would stop this config from running here (empty when it can run);
    ``here = False``: its roles run elsewhere (a cluster), whose model cache is not checked;
    ``None``: as its launcher says (``runs_here``)."""
    manager = manager or get_plugin_manager()
    on_this_machine = runs_here(config, manager)
    here = on_this_machine if here is None else here
    problems: list[str] = []
    for key, value, marker in _marked(config):
        problems.extend(_check_one(manager, key, value, marker))
    if hasattr(config, "launcher"):
        try:
            manager.select("launchers", resolve_launcher(config, manager), key="launcher")
        except PluginError as exc:
            problems.append(str(exc))
    active = {r.name for r in manager.active()}
    for name in getattr(config, "required_plugins", []):
        if name not in active:
            known = {r.name: r for r in manager.status()}
            why = f": {known[name].status}, {known[name].reason}" if name in known else " (not installed)"
            problems.append(f"required_plugins: plugin '{name}' is not active{why}{did_you_mean(name, active)}")
    if here:
        problems.extend(hub_problems(config))
        problems.extend(_sft_dataset_problems(config, root))
    problems.extend(_environment_problems(config, root))
    problems.extend(_data_problems(config, root))
    problems.extend(_degree_problems(config, root, manager))
    problems.extend(env_args_problems(config, root, manager))
    problems.extend(_plugin_validators(config, root, manager, on_this_machine))
    return problems


def _environment_problems(config: BaseModel, root: str) -> list[str]:
    """An RL run (or an orchestrator) needs an environment to sample tasks from."""
    orchestrator, key = (getattr(config, "orchestrator", None), "orchestrator.env") if root == "rl" else (
        (config, "env") if root == "orchestrator" else (None, ""))
    if orchestrator is None or getattr(config, "bench", None) or orchestrator.env:
        return []
    return [f"{key}: no environment configured; add one, e.g. [[{key}]] id = \"NAME\" with a NAME `prime plugins "
            "list` shows"]


def _data_problems(config: BaseModel, root: str) -> list[str]:
    """An SFT data file read through once, before anything starts: every line a JSON chat
    sample ending with the assistant's turn (tokenizing is left to the run)."""
    data = getattr(config, "data", None) if root == "sft" else None
    if data is None or data.type != "jsonl" or data.path is None or getattr(config, "bench", None):
        return []
    from prime_core.sft.data import file_problems

    return file_problems(data.path)


def _sft_dataset_problems(config: BaseModel, root: str) -> list[str]:
    """SFT's ``data.name`` (every subset/split pair) where offline roles would not find it."""
    data = getattr(config, "data", None) if root == "sft" else None
    if data is None or data.type != "sft" or getattr(config, "bench", None):
        return []
    from prime_core.errors import ConfigError
    from prime_core.hf_data import cache_problem
    from prime_core.sft.hf import subsets_and_splits

    try:
        pairs = subsets_and_splits(data)
    except ConfigError as exc:
        return list(exc.problems)
    found = (cache_problem(data.name, subset, split, who="sft", key="data.name") for subset, split in pairs)
    return [f"data.name: {problem}" for problem in found if problem]


def hub_problems(config: BaseModel) -> list[str]:
    """Models named by a hub id that offline roles cannot load (each name once)."""
    from prime_core.config.shared import ModelRef
    from prime_core.hub import cache_problem

    found: dict[str, str] = {}

    def visit(section: BaseModel, prefix: str) -> None:
        if isinstance(section, ModelRef):
            for field in ("name", "tokenizer"):
                name = getattr(section, field)
                if name and name not in found:
                    problem = cache_problem(name, f"{prefix}{field}")
                    if problem:
                        found[name] = problem
            return
        for key in type(section).model_fields:
            value = getattr(section, key)
            if isinstance(value, BaseModel):
                visit(value, f"{prefix}{key}.")

    visit(config, "")
    return list(found.values())


def _degree_problems(config: BaseModel, root: str, manager: PluginManager) -> list[str]:
    """Parallel degrees against the default deployment (one process); a config that names its
    deployment is checked when it is loaded."""
    from prime_core.launch.config import degree_problems

    if "deployment" in config.model_fields_set:
        return []
    return degree_problems(config, root, manager, where="the default deployment: one process")


def _plugin_validators(config: BaseModel, root: str, manager: PluginManager, here: bool = True) -> list[str]:
    out: list[str] = []
    for impl in manager.pm.hook.prime_validate_config.get_hookimpls():
        kwargs = {"config": config, "root": root, "here": here}
        try:
            result = impl.function(*[kwargs[a] for a in impl.argnames])
            out.extend(str(m) for m in (result or []))
        except Exception as exc:
            out.append(f"plugin '{impl.plugin_name}' failed while validating the config: {type(exc).__name__}: {exc}")
    return out
