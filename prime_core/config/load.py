"""Load, merge and validate a config.

Sources, lowest precedence first:

1. the schema's defaults;
2. config files (YAML, TOML or JSON, read by dynaconf), merged left to right;
3. environment variables ``PRIME_<KEY>__<SUBKEY>=value`` (``__`` nests; values are parsed
   by dynaconf as TOML literals, so ``PRIME_TRAINER__OPTIM__LR=1e-5`` is a float);
4. command-line overrides (``--trainer.optim.lr 1e-5``).

Merging is ours, not dynaconf's: tables merge key by key, while lists and scalars from a
later source replace earlier ones (dynaconf's own merge would union lists, so two files
each listing ``[[orchestrator.env]]`` would silently train on both).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from prime_core.config.cli_args import Override, ParsedArgs
from prime_core.config.report import format_validation_error, with_sources
from prime_core.errors import ConfigError

ENV_PREFIX = "PRIME"
SUFFIXES = {".toml": "TOML", ".yaml": "YAML", ".yml": "YAML", ".json": "JSON"}

Provenance = dict[tuple[str, ...], str]


def _lower_keys(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k).lower(): _lower_keys(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_lower_keys(v) for v in value]
    return value


def _plain(value: Any) -> Any:
    """dynaconf's Box/BoxList objects as plain dicts and lists."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


@functools.cache
def _dynaconf_internal_keys() -> frozenset[str]:
    # dynaconf reports some of its own settings in as_dict(); learn them from an empty load.
    from dynaconf import Dynaconf

    return frozenset(Dynaconf(environments=False, load_dotenv=False, loaders=[]).as_dict())


def read_file(path: Path) -> dict[str, Any]:
    """One config file as a plain dict (top-level keys lower-cased, as dynaconf upper-cases them)."""
    if not path.exists():
        raise ConfigError([f"config file not found: {path}"])
    if not path.is_file():
        raise ConfigError([f"config path is not a file: {path}"])
    loader = SUFFIXES.get(path.suffix.lower())
    if loader is None:
        raise ConfigError([f"{path}: unsupported config format '{path.suffix}' (use .toml, .yaml, .yml or .json)"])
    from dynaconf import Dynaconf

    try:
        settings = Dynaconf(
            settings_files=[str(path.resolve())],
            core_loaders=[loader],
            loaders=[],  # no environment variables here: they are a layer of their own
            environments=False,
            load_dotenv=False,
            merge_enabled=False,
        )
        data = settings.as_dict()
    except Exception as exc:  # each format's parser raises its own error type
        raise ConfigError([f"{path}: could not parse {loader}: {_first_line(exc)}"]) from None
    internal = _dynaconf_internal_keys()
    return {k.lower(): _plain(v) for k, v in data.items() if k not in internal}


def _first_line(exc: Exception) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0] if len(text.splitlines()) < 4 else " ".join(text.split())[:300]


def config_variables(environ: Mapping[str, str], top_level_keys: set[str]) -> list[str]:
    """The names of the ``PRIME_*`` variables ``read_env`` takes as config keys."""
    from prime_core.plugins import CONTROL_ENV

    prefix = f"{ENV_PREFIX}_"
    return sorted(name for name in environ if name.startswith(prefix) and name not in CONTROL_ENV
                  and ("__" in name[len(prefix):] or name[len(prefix):].lower() in top_level_keys))


def read_env(environ: Mapping[str, str], top_level_keys: set[str]) -> dict[str, Any]:
    """``PRIME_*`` variables as a nested dict.

    A variable without ``__`` whose name is not a top-level key (``PRIME_API_KEY`` of another
    tool, or prime's own ``PRIME_DISABLED_PLUGINS``) is ignored rather than refused.
    """
    from dynaconf.utils.parse_conf import parse_conf_data

    prefix = f"{ENV_PREFIX}_"
    data: dict[str, Any] = {}
    for name in config_variables(environ, top_level_keys):
        value = environ[name]
        path = tuple(p.lower() for p in name[len(prefix) :].split("__"))
        node = data
        for part in path[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[path[-1]] = _plain(parse_conf_data(value, tomlfy=True, box_settings={}))
    return data


def merge_into(base: dict[str, Any], top: Mapping[str, Any], source: str, provenance: Provenance,
               prefix: tuple[str, ...] = (), schema: type[BaseModel] | None = None) -> None:
    """``top`` over ``base``, recording where each leaf came from. With ``schema``, a key given
    by another of its names replaces the one set before (``group_size`` in an overlay file over
    ``rollouts_per_example`` in the base), where two names in one file are refused."""
    names = _other_names(schema, prefix) if schema is not None else {}
    for key, value in top.items():
        path = (*prefix, key)
        for other in names.get(key, ()):
            if other in base and other not in top:
                del base[other]
                for old in [p for p in provenance if p[: len(prefix) + 1] == (*prefix, other)]:
                    del provenance[old]
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            merge_into(base[key], value, source, provenance, path, schema)
            continue
        base[key] = _plain(value)
        for old in [p for p in provenance if p[: len(path)] == path]:
            del provenance[old]
        _record(base[key], path, source, provenance)


def _other_names(schema: type[BaseModel], prefix: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """For the section at ``prefix``: each accepted name of a field -> its field's other names."""
    from prime_core.config.schema import model_at

    model = model_at(schema, prefix) if prefix else schema
    groups: dict[str, tuple[str, ...]] = {}
    for field, info in (model.model_fields.items() if model is not None else ()):
        names = {field, *getattr(info.validation_alias, "choices", ())}
        if len(names) > 1:
            for name in names:
                groups[str(name)] = tuple(str(n) for n in names - {name})
    return groups


def _record(value: Any, path: tuple[str, ...], source: str, provenance: Provenance) -> None:
    provenance[path] = source
    if isinstance(value, dict):
        for k, v in value.items():
            _record(v, (*path, k), source, provenance)


def _nest(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    for part in reversed(path):
        value = {part: value}
    return value


def gather(args: ParsedArgs, schema: type[BaseModel], environ: Mapping[str, str] | None = None
           ) -> tuple[dict[str, Any], Provenance]:
    """The merged raw config, and where each leaf came from."""
    environ = os.environ if environ is None else environ
    data: dict[str, Any] = {}
    provenance: Provenance = {}
    problems: list[str] = []
    for mount, path in args.files:
        try:
            content = read_file(path)
        except ConfigError as exc:
            problems.extend(exc.problems)
            continue
        merge_into(data, _nest(mount, content) if mount else content, str(path), provenance, schema=schema)
    if problems:
        raise ConfigError(problems)
    env = read_env(environ, set(schema.model_fields))
    merge_into(data, env, "environment", provenance)
    for override in args.overrides:
        _apply(data, override, provenance, schema)
    return data, provenance


def _apply(data: dict[str, Any], override: Override, provenance: Provenance,
           schema: type[BaseModel] | None = None) -> None:
    merge_into(data, _nest(override.path, override.value), override.source, provenance, schema=schema)


def validate(schema: type[BaseModel], data: dict[str, Any], provenance: Provenance | None = None,
             *, source: str | None = None, root: str | None = None, manager=None) -> BaseModel:
    """The validated config; every problem at once as a ``ConfigError``. With ``root`` and
    ``manager``, an unknown key that a known plugin provides names that plugin and the fix."""
    if root is not None:
        from prime_core.config.prime_rl import newer_layout_problem

        backends = tuple(manager.registry("inference_backends")) if manager is not None else ()
        newer = newer_layout_problem(data, root, backends)
        if newer:
            raise ConfigError([newer], source=source)
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        owner_of = None
        if root is not None and manager is not None:
            from prime_core.plugin_index import key_owner, owner_hint

            def owner_of(key: str) -> str | None:
                entry = key_owner(root, key)
                return owner_hint(entry, manager) if entry else None
        raise ConfigError(format_validation_error(exc, schema, provenance or {}, owner_of), source=source) from None


def load(root: str, args: ParsedArgs, *, manager=None, environ: Mapping[str, str] | None = None
         ) -> tuple[BaseModel, Provenance]:
    """Load and validate a config for ``root``; returns it and where each key was set (for the
    problems found later: ``report.with_sources``)."""
    from prime_core.config.checks import schema_for
    from prime_core.launch.config import degree_problems
    from prime_core.plugins import get_plugin_manager

    manager = manager or get_plugin_manager()
    schema = schema_for(root, manager)
    data, provenance = gather(args, schema, environ)
    sources = ", ".join(str(p) for _, p in args.files) or None
    config = validate(schema, data, provenance, source=sources, root=root, manager=manager)
    problems = config.problems() if hasattr(config, "problems") else []
    # A knobs-only file (the seeds' snippets) is checked against a deployment once it has one.
    if not problems and "deployment" in config.model_fields_set:
        problems = degree_problems(config, root, manager)
    if problems:
        raise ConfigError(with_sources(problems, provenance), source=sources)
    return config, provenance
