"""Turn pydantic's validation errors into one line per problem: the key path, where the
value came from, what is wrong, and a suggestion."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationError

from prime_core.config.schema import all_paths, field_names, model_at
from prime_core.errors import did_you_mean


def _dotted(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _strip_tags(loc: tuple[Any, ...], schema: type[BaseModel]) -> tuple[Any, ...]:
    """Drop the union tags and function names pydantic adds to locations (``single_node``,
    ``function-before[...]``), keeping only real keys and list indices."""
    keep: list[Any] = []
    for part in loc:
        if isinstance(part, str) and ("[" in part or part.startswith("function-")):
            continue
        if isinstance(part, str) and keep and model_at(schema, tuple(keep)) is None:
            # a union tag: the parent is ambiguous until the tag picks a member
            if model_at(schema, (*keep, part)) is not None and part not in _names_at(schema, tuple(keep)):
                continue
        keep.append(part)
    return tuple(keep)


def _names_at(schema: type[BaseModel], loc: tuple[Any, ...]) -> set[str]:
    model = model_at(schema, loc)
    return field_names(model) if model is not None else set()


def _source(provenance: dict[tuple[str, ...], str], loc: tuple[Any, ...]) -> str:
    key = tuple(p for p in loc if isinstance(p, str))
    while key:
        if key in provenance:
            return f" (from {provenance[key]})"
        key = key[:-1]
    return ""


_KEY = re.compile(r"(?<![\w./-])[a-z_][a-z0-9_]*(?:\[\d+\])*(?:\.[a-z0-9_]+(?:\[\d+\])*)+(?![\w/\[-])")
"""A dotted key in a problem's text (``trainer.seq_len``, ``orchestrator.env[0].id``), not part of
a path or a file name."""


def _key_source(provenance: dict[tuple[str, ...], str], key: str) -> str | None:
    path = tuple(key.split("[")[0].split("."))  # an item of a list was set with the list
    # A role's copy of a shared key (trainer.model.name from [model]) was set where the shared key was.
    source = provenance.get(path) or provenance.get(path[1:])
    # An option on the command line is in the command the user typed (and its value in the problem).
    return None if source is None or source.startswith("--") else source


def with_sources(problems: list[str], provenance: dict[tuple[str, ...], str]) -> list[str]:
    """The problems found after the schema, the first mention of each key followed by the file
    (or the environment) that set it, as the schema's own errors say it: ``trainer.seq_len (from
    rl.toml) = 256 is shorter than ...``. Keys at their defaults, or set on the command line,
    are left as they are."""
    seen: set[str] = set()

    def annotate(match: re.Match) -> str:
        key = match.group(0)
        source = None if key in seen else _key_source(provenance, key)
        if source is None or match.string.startswith(" (from ", match.end()):
            return key
        seen.add(key)
        return f"{key} (from {source})"
    return [_KEY.sub(annotate, problem) for problem in problems]


def format_validation_error(exc: ValidationError, schema: type[BaseModel], provenance: dict[tuple[str, ...], str],
                            owner_of: Callable[[str], str | None] | None = None) -> list[str]:
    """One line per problem. ``owner_of(key)`` names the plugin that would provide an unknown
    key and the fix, when one is known. A shared key's problem is reported once, at the top
    level, not again in each role it was copied into."""
    found: list[tuple[tuple[Any, ...], str, str]] = []  # (loc, key and source, what is wrong)
    paths = None
    for error in exc.errors(include_url=False):
        raw_loc = tuple(error["loc"])
        loc = _strip_tags(raw_loc, schema)
        key = _dotted(loc) or "(top level)"
        where = _source(provenance, tuple(p for p in loc))
        kind = error["type"]
        if kind == "extra_forbidden":
            parent = model_at(schema, raw_loc[:-1])
            leaf = str(loc[-1])
            alias_of = _alias_owner(parent, leaf) if parent is not None else None
            if alias_of:
                found.append((loc, f"{key}{where}", f"another name of '{alias_of}', which is set too: give only one"))
                continue
            siblings = field_names(parent) if parent is not None else set()
            owner = owner_of(key) if owner_of is not None else None
            hint = f" (a key of {owner})" if owner else did_you_mean(leaf, siblings)
            if not hint:
                paths = paths if paths is not None else all_paths(schema)
                homes = [p.rsplit(".", 1)[0] if "." in p else "the top level"
                         for p in paths if p.rsplit(".", 1)[-1] == leaf]
                if homes:
                    hint = f" ('{leaf}' is a key of {', '.join(homes[:3])})"
                else:
                    hint = " (if a plugin provides it, install or enable that plugin: `prime plugins list`)"
            found.append((loc, f"{key}{where}", f"unknown key{hint}"))
        elif kind == "missing":
            found.append((loc, f"{key}{where}", "required key is missing"))
        else:
            message = error["msg"]
            if message.startswith("Value error, "):
                message = message[len("Value error, ") :]
            value = error.get("input")
            shown = "" if isinstance(value, dict | list) or kind.startswith("value_error") else f" (got {value!r})"
            if kind in ("int_parsing", "float_parsing") and value in ("true", "false"):
                shown += ": a number is needed (an option given without its value?)"
            elif value is True:
                shown += ": a value is needed (an option given without its value?)"
            found.append((loc, f"{key}{where}", f"{message}{shown}"))
    shared = getattr(schema, "shared_keys", {})
    top = {(loc, what) for loc, _, what in found}
    return [f"{head}: {what}" for loc, head, what in found
            if not (len(loc) > 1 and loc[0] in shared.get(loc[1], ()) and (loc[1:], what) in top)]


def _alias_owner(model: type[BaseModel], name: str) -> str | None:
    """The field that ``name`` is another accepted name of (``max_completion_tokens`` of ``max_tokens``)."""
    for field, info in model.model_fields.items():
        choices = getattr(info.validation_alias, "choices", ())
        if name != field and name in choices:
            return field
    return None
