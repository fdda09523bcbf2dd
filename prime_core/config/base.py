"""Building blocks shared by every config section."""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, TypeVar

from pydantic import AfterValidator, AliasChoices, BaseModel, BeforeValidator, ConfigDict, model_validator

T = TypeVar("T")


def _numeric(annotation: Any) -> bool:
    """Whether a field holds a number (``int``, ``float``, optional or annotated)."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _numeric(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        return bool(members) and all(_numeric(a) for a in members)
    return annotation in (int, float)


class Section(BaseModel):
    """A config section: unknown keys are refused, attribute docstrings document each key."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True,
                              populate_by_name=True)

    prime_rl_keys: ClassVar[tuple[str, ...]] = ()
    """prime-rl's keys (dotted, relative to this section) that a ``mode="before"`` validator of
    this section reads into prime's own keys: their home (``prime_core.config.prime_rl.has_home``)."""

    @model_validator(mode="before")
    @classmethod
    def _no_flag_for_a_number(cls, data: Any) -> Any:
        # pydantic reads true as 1: `--trainer.optim.lr` left without its value trained at lr 1.0.
        # As the text "true" the number field refuses it (the report adds the likely cause).
        if not isinstance(data, dict) or not any(isinstance(v, bool) for v in data.values()):
            return data
        numeric = {name for name, info in cls.model_fields.items() if _numeric(info.annotation)}
        for name, info in cls.model_fields.items():
            if name in numeric and isinstance(info.validation_alias, AliasChoices):
                numeric.update(c for c in info.validation_alias.choices if isinstance(c, str))
        return {k: (str(v).lower() if isinstance(v, bool) and k in numeric else v) for k, v in data.items()}

    @model_validator(mode="before")
    @classmethod
    def _dashes_are_underscores(cls, data: Any) -> Any:
        # prime-rl's loader reads `micro-batch-size` as `micro_batch_size` (as prime's command line does).
        if not isinstance(data, dict) or not any(isinstance(k, str) and "-" in k for k in data):
            return data
        names = set(cls.model_fields)
        for info in cls.model_fields.values():
            if isinstance(info.validation_alias, AliasChoices):
                names.update(c for c in info.validation_alias.choices if isinstance(c, str))
        out = {}
        for key, value in data.items():
            under = key.replace("-", "_") if isinstance(key, str) else key
            out[under if key not in names and under in names and under not in data else key] = value
        return out


def walk_fields(model: BaseModel, prefix: str = "", *, into: Callable[[Any], bool] = lambda info: True):
    """``(dotted key, value, field info, owning section)`` for every field of ``model`` and of the
    sections below it (a list of sections by index: ``env[0].id``), depth first; nothing below a
    field whose ``into(info)`` is false."""
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        key = f"{prefix}{name}"
        yield key, value, info, model
        if not into(info):
            continue
        if isinstance(value, BaseModel):
            yield from walk_fields(value, f"{key}.", into=into)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    yield from walk_fields(item, f"{key}[{i}].", into=into)


def merge_tables(base: Any, top: Any) -> Any:
    """``top`` wins; dicts merge recursively."""
    if isinstance(base, dict) and isinstance(top, dict):
        out = dict(base)
        for k, v in top.items():
            out[k] = merge_tables(base[k], v) if k in base else v
        return out
    return top


def _toggle(value: Any) -> Any:
    # prime-rl's convention: `[trainer.model.compile]` (an empty table), `--trainer.model.compile`
    # (true) turn an optional section on with its defaults; false / "None" turn it off.
    if value is True:
        return {}
    if value is False or (isinstance(value, str) and value.lower() in ("none", "null")):
        return None
    return value


# An optional sub-section that `true`, `{}` or a table turns on and `false`/`None` turns off.
Toggle = Annotated[T | None, BeforeValidator(_toggle)]


@dataclass(frozen=True)
class Selects:
    """Marks a string field whose value names an entry of a plugin registry.

    ``prime config validate`` (and every real run) checks that an active plugin provides it.
    ``prefix`` is prepended to the value to form the registry key (``loss:`` for algorithms).
    ``skip`` lists values that are resolved elsewhere (``auto``); ``when(section)`` limits the
    check to configs where the field is used.
    """

    registry: str
    prefix: str = ""
    skip: tuple[str, ...] = ()
    when: Callable[[Any], bool] | None = None
    each: bool = False
    """The field is a list; every item names an entry."""
    mapping: bool = False
    """The field is a dict ``{op: name}``; every item names the entry ``op:name``."""


@dataclass(frozen=True)
class Requires:
    """Marks a field that, when turned on, needs a plugin capability by name:
    ``degree: Annotated[int, Requires("parallel_strategies", "widget", when=lambda m: m.degree > 1)]``.
    Without ``when`` the field needs it whenever it is set (not ``None``/``False``). A name
    ending in ``*`` accepts any entry with that prefix (``fp8_linear:*``); ``slot`` instead of a
    name asks for any parallel strategy of that build-order slot."""

    registry: str
    name: str = ""
    when: Callable[[Any], bool] | None = None
    slot: str | None = None


@dataclass(frozen=True)
class Noted:
    """Marks a key prime-rl has and prime accepts without doing what it does in prime-rl, because
    prime does that part differently: set to anything but its default, it prints one line (the
    key, its value and ``note``: what prime does instead) when the config is loaded. Nothing is
    silently ignored (``prime_core.config.prime_rl.notes``)."""

    note: str
    when: Callable[[Any], bool] | None = None
    """Say it only for values where this is true (by default: any value but the default)."""


SECRET_WORDS = ("api_key", "apikey", "token", "secret", "password")


def _no_secrets(value: Any) -> Any:
    # A config is written to output_dir/configs/ and shown by --dry-run and `prime config show`:
    # a secret in it would be on disk and in logs. Secrets travel in the environment or a file.
    if isinstance(value, dict):
        found = sorted(str(k) for k in value if any(w in str(k).lower().replace("-", "_") for w in SECRET_WORDS))
        if found:
            raise ValueError(f"{', '.join(found)}: a secret would be written to output_dir/configs/*.json and shown "
                             "by --dry-run; export it in the environment of the command instead (an API key for the "
                             "inference server: inference.server.api_key_var or api_key_file)")
    return value


NoSecrets = BeforeValidator(_no_secrets)
"""For tables passed through to processes (``args``, ``env``, ``env_vars``): no key that names
a secret (``api_key``, ``HF_TOKEN``, ``..._PASSWORD``)."""


def _existing_file(path: Path) -> Path:
    path = path.expanduser()
    if not path.is_file():
        raise ValueError(f"file not found: {path}" + ("" if path.is_absolute() else f" (resolved from {Path.cwd()})"))
    return path


ExistingFile = Annotated[Path, AfterValidator(_existing_file)]
