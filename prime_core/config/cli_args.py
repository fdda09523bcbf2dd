"""Command-line arguments of every config-taking command.

    prime run a.yaml b.toml --trainer.optim.lr 1e-5 --no-trainer.model.reshard-after-forward
    prime run @ a.toml @ b.toml --trainer.model.ac.targets norm attn_proj
    prime run --trainer @ trainer.toml --orchestrator @ orch.toml

- Positional arguments and ``@ FILE`` / ``@FILE`` are config files, merged left to right.
- ``--a.b.c VALUE`` sets a key; ``-`` and ``_`` are the same in key names. Values are read
  as JSON when they parse (numbers, ``true``, ``[1, 2]``, ``{"k": 1}``), ``None``/``null``
  is null, anything else is a string. Several values make a list.
- ``--a.b.c`` alone sets ``true`` (or turns an optional section on); ``--no-a.b.c`` sets ``false``.
- ``--a.b @ FILE`` loads a file under key ``a.b``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prime_core.errors import ConfigError


@dataclass
class Override:
    path: tuple[str, ...]
    value: Any
    source: str


@dataclass
class ParsedArgs:
    files: list[tuple[tuple[str, ...], Path]] = field(default_factory=list)
    """(key path to mount under, file); the path is empty for whole-config files."""
    overrides: list[Override] = field(default_factory=list)


def parse_value(text: str) -> Any:
    if text in ("None", "none", "null"):
        return None
    if text in ("True", "False"):
        return text == "True"
    try:
        return json.loads(text)
    except ValueError:
        return text


def _is_value(token: str) -> bool:
    if not token.startswith("-"):
        return True
    try:
        float(token)
        return True
    except ValueError:
        return False


def _key(raw: str, token: str) -> tuple[str, ...]:
    parts = tuple(p.replace("-", "_") for p in raw.split("."))
    if not raw or any(not p for p in parts):
        raise ConfigError([f"'{token}': not a valid key (expected --section.key VALUE)"])
    return parts


def parse_args(tokens: list[str]) -> ParsedArgs:
    out = ParsedArgs()
    problems: list[str] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token == "@":
            if i + 1 >= len(tokens):
                problems.append("'@' must be followed by a config file")
                break
            out.files.append(((), Path(tokens[i + 1])))
            i += 2
            continue
        if token.startswith("@"):
            out.files.append(((), Path(token[1:])))
            i += 1
            continue
        if not token.startswith("--"):
            if token.startswith("-") and not _is_value(token):
                problems.append(f"'{token}': options take two dashes (--section.key VALUE)")
            else:
                out.files.append(((), Path(token)))
            i += 1
            continue
        raw, eq, inline = token[2:].partition("=")
        if eq:
            out.overrides.append(Override(_key(raw, token), parse_value(inline), token))
            i += 1
            continue
        values: list[str] = []
        j = i + 1
        while j < len(tokens) and _is_value(tokens[j]) and tokens[j] != "@":
            values.append(tokens[j])
            j += 1
        if not values and j < len(tokens) and tokens[j] == "@":
            if j + 1 >= len(tokens):
                problems.append(f"'{token} @' must be followed by a config file")
                break
            out.files.append((_key(raw, token), Path(tokens[j + 1])))
            i = j + 2
            continue
        if not values:
            if raw.startswith("no-") or raw.startswith("no_"):
                out.overrides.append(Override(_key(raw[3:], token), False, token))
            else:
                out.overrides.append(Override(_key(raw, token), True, token))
        elif len(values) == 1:
            out.overrides.append(Override(_key(raw, token), parse_value(values[0]), f"{token} {values[0]}"))
        else:
            parsed = [parse_value(v) for v in values]
            out.overrides.append(Override(_key(raw, token), parsed, f"{token} {' '.join(values)}"))
        i = j
    if problems:
        raise ConfigError(problems, source="command line")
    return out
