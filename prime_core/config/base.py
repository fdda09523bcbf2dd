"""Building blocks shared by every config section."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict

T = TypeVar("T")


class Section(BaseModel):
    """A config section: unknown keys are refused, attribute docstrings document each key."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True,
                              populate_by_name=True)


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


def _existing_file(path: Path) -> Path:
    path = path.expanduser()
    if not path.is_file():
        raise ValueError(f"file not found: {path}" + ("" if path.is_absolute() else f" (resolved from {Path.cwd()})"))
    return path


ExistingFile = Annotated[Path, AfterValidator(_existing_file)]
