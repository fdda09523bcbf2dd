"""prime-rl's config layouts: what prime reads of them and what it says about the rest.

prime reads the configs of prime-rl's v0.5 and v0.6 releases unchanged (docs/prime-rl.md):
every key of that era is either a prime key by the same name (or an alias of one: ``group_size``,
``max_async_level``, ``clean_output_dir``), moved where prime keeps it by the section that reads
it (``[orchestrator.train]`` into ``orchestrator``), or ``Noted``: accepted, and named in one
warning line that says what prime does instead. This module finds those lines, and recognises
the newer layout (prime-rl v0.8 on), which it refuses with one message instead of a list of
unknown keys.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from prime_core.config.base import Noted, walk_fields

DOCS = "docs/prime-rl.md"


def _default(info) -> Any:
    if info.default_factory is not None:
        try:
            return info.default_factory()
        except TypeError:  # a factory that takes the validated data
            return None
    return info.default


def _shown(value: Any) -> str:
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json", exclude_defaults=True)
    try:
        text = json.dumps(value, default=str)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _noted(info) -> Noted | None:
    return next((m for m in info.metadata if isinstance(m, Noted)), None)


def _set_notes(config: BaseModel):
    """(dotted key, value, note) for every noted key that is set (nothing below one is looked at)."""
    for key, value, info, _ in walk_fields(config, into=lambda info: _noted(info) is None):
        marker = _noted(info)
        if marker is None:
            continue
        if marker.when is not None:
            if marker.when(value):
                yield key, value, marker.note
        elif value is not None and value != _default(info) and value not in ({}, []):
            yield key, value, marker.note


def notes(config: BaseModel) -> list[str]:
    """One line per prime-rl key that is set and that prime does not use as prime-rl does. A key
    that a top-level table copied into several roles is named once with each place."""
    grouped: dict[tuple[str, str, str], list[str]] = {}
    for key, value, note in _set_notes(config):
        leaf = key.rsplit(".", 1)[-1]
        grouped.setdefault((leaf, _shown(value), note), []).append(key)
    return [f"{', '.join(keys)} = {shown}: {note}" for (_, shown, note), keys in grouped.items()]


# The newer layout: where each of its marks sits, by root, and what prime reads instead.
NEWER_LAYOUT = (
    (("orchestrator", "train", "source"), "[[orchestrator.train.source]] (v0.8.0)",
     "[[orchestrator.train.env]] (or [[orchestrator.env]]) with id, name and args"),
    (("monitors",), "[monitors.*] tables (after v0.8.0)",
     "the monitor plugins' tables at the top level ([NAME], `prime plugins list` names them)"),
    (("inference", "{backend}"), "[inference.{backend}] (after v0.8.0)",
     "the inference server's options under [inference] and [inference.model]"),
)
"""``{backend}``: each inference backend's name (the newer layout gives its options a table of its own)."""


def _at(data: Any, path: tuple[str, ...]) -> Any:
    for part in path:
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def newer_layout_problem(data: dict, root: str, backends: tuple[str, ...] = ()) -> str | None:
    """The one message for a config of prime-rl's newer layout (``None`` for any other);
    ``backends``: the names of the installed inference backends."""
    found = []
    marks = [(path, mark, instead) for path, mark, instead in NEWER_LAYOUT if "{backend}" not in path[-1]]
    for name in backends:
        marks.extend((tuple(p.format(backend=name) for p in path), mark.format(backend=name), instead)
                     for path, mark, instead in NEWER_LAYOUT if "{backend}" in path[-1])
    for path, mark, instead in marks:
        if root != "rl" and path[0] == root:
            path = path[1:]
        elif root != "rl" and path[0] in ("orchestrator", "inference"):
            continue
        value = _at(data, path)
        # `monitors` is prime's list of metric sinks; only a table of tables is the newer layout.
        if isinstance(value, dict) if path[-1] in ("monitors", *backends) else value is not None:
            found.append((mark, instead))
    if not found:
        return None
    marks = ", ".join(m for m, _ in found)
    instead = "; ".join(i for _, i in found)
    return (f"this config uses prime-rl's newer layout ({marks}), which prime does not read. prime reads the "
            f"layout of prime-rl v0.5 and v0.6: write {instead} (see {DOCS} for the whole mapping)")


def _moved(model: type[BaseModel]) -> set[str]:
    return {key for klass in model.__mro__ for key in getattr(klass, "prime_rl_keys", ())}


def has_home(root: type[BaseModel], path: str) -> bool:
    """Whether prime's schema ``root`` has a home for prime-rl's dotted key ``path``: a field (or
    an alias of one) at every level, a key a section's validator reads (``prime_rl_keys``), or a
    place inside a free-form table (``dict``). Union members are tried in turn."""
    from prime_core.config.schema import _by_alias, _models_in

    def walk(model: type[BaseModel], parts: list[str]) -> bool:
        rest = ".".join(parts)
        if any(rest == key or rest.startswith(f"{key}.") for key in _moved(model)):
            return True
        info = model.model_fields.get(parts[0]) or _by_alias(model, parts[0])
        if info is None:
            return False
        if len(parts) == 1:
            return True
        members = _models_in(info.annotation)
        if not members:
            return "dict" in str(info.annotation) or "Any" in str(info.annotation)
        return any(walk(member, parts[1:]) for member in members)

    return walk(root, path.split("."))
