"""One pydantic schema per root, assembled from the core's sections and the plugins'.

Roots: ``rl`` (``prime run``), ``sft``, and the standalone roles ``trainer``,
``orchestrator`` and ``inference`` (what ``--dry-run`` writes for each role). A plugin's
``ConfigSection`` is mounted by subclassing every model on its path, so the core's own
validators keep working and ``extra="forbid"`` still refuses unknown keys everywhere.
"""

from __future__ import annotations

import copy
import types
import typing
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, create_model
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from prime_core.config.base import Section, Toggle
from prime_core.config.rl import RLConfig
from prime_core.config.shared import ROLES
from prime_core.errors import PluginError
from prime_core.inference.config import InferenceConfig
from prime_core.orchestrator.config import OrchestratorConfig
from prime_core.sft.config import SFTConfig
from prime_core.specs import ConfigSection
from prime_core.trainer.config import TrainerConfig

BASE_ROOTS: dict[str, type[BaseModel]] = {
    "rl": RLConfig,
    "sft": SFTConfig,
    "trainer": TrainerConfig,
    "orchestrator": OrchestratorConfig,
    "inference": InferenceConfig,
}


def sections_for(root: str, sections: list[tuple[ConfigSection, str]]) -> list[tuple[str, ConfigSection, str]]:
    """(path relative to ``root``, section, provider) for every place a section mounts in ``root``."""
    out = []
    for section, provider in sections:
        name = section.name
        if root in section.roots:
            out.append((name.removeprefix("trainer.") if root == "sft" else name, section, provider))
        elif root in ROLES and "rl" in section.roots and name.startswith(f"{root}."):
            out.append((name[len(root) + 1:], section, provider))
        elif root in ROLES and "rl" in section.roots and name == root and section.merge:
            out.append(("", section, provider))  # keys of the role's own table
        elif root in section.roles:
            out.append((name, section, provider))
        if root == "rl" and "rl" in section.roots:
            out.extend((f"{role}.{name}", section, provider) for role in section.roles)
    return sorted(out, key=lambda t: (t[0].count("."), t[0]))


def build_schema(root: str, sections: list[tuple[ConfigSection, str]]) -> type[BaseModel]:
    """The root model for ``root`` with every applicable plugin section mounted."""
    cls = BASE_ROOTS[root]
    owners: dict[str, str] = {}
    for path, section, provider in sections_for(root, sections):
        if not path:  # merged into the root itself
            cls = _merge(cls, "", section, provider, owners)
            continue
        cls = _mount(cls, path.split("."), section, provider, owners, prefix="")
        if root == "rl" and "." not in path and section.roles:
            cls.shared_keys = {**cls.shared_keys, path: tuple(section.roles)}
    for name, source in getattr(cls, "mirrors", {}).items():  # the same section, plugins' keys included
        extended = _model_in(cls, source, source, "prime-core")
        original = _model_in(BASE_ROOTS[root], source, source, "prime-core")
        if extended is not original:
            cls = _replace_field(cls, name, original, extended)
    return cls


def _merge(target: type[BaseModel], here: str, section: ConfigSection, provider: str,
           owners: dict[str, str]) -> type[BaseModel]:
    """``target`` extended with the section's fields and validators (it inherits from both)."""
    ours = _validator_names(section.model)
    clash = sorted(ours & _validator_names(target))
    if clash:
        # Validators are methods: one of the same name would silently replace the other.
        raise PluginError(f"plugin '{provider}' adds validator {clash[0]!r} to '{here or 'the root config'}', "
                          "which already has one of that name: give it a name of its own (e.g. prefixed with "
                          "the plugin's name)")
    fields = {}
    for name, info in section.model.model_fields.items():
        key = f"{here}.{name}" if here else name
        if name in target.model_fields:
            owner = owners.get(key, "prime-core")
            raise PluginError(f"config key '{key}' is defined by both {owner} and plugin '{provider}'")
        owners[key] = f"plugin '{provider}'"
        fields[name] = (info.annotation, copy.copy(info))  # keeps each key's docstring
    return create_model(target.__name__, __base__=(target, section.model), __doc__=target.__doc__,
                        __module__=target.__module__, **fields)


def _validator_names(model: type[BaseModel]) -> set[str]:
    """Names of the model's validators, less those every ``Section`` has (inherited by both
    sides of a merge, they cannot clash)."""
    decorators = model.__pydantic_decorators__
    names = {name for kind in ("model_validators", "field_validators") for name in getattr(decorators, kind)}
    common = Section.__pydantic_decorators__
    return names - {name for kind in ("model_validators", "field_validators") for name in getattr(common, kind)}


def _mount(cls: type[BaseModel], parts: list[str], section: ConfigSection, provider: str,
           owners: dict[str, str], prefix: str) -> type[BaseModel]:
    head, rest = parts[0], parts[1:]
    here = f"{prefix}{head}"
    if section.merge and not rest:
        target = _model_in(cls, head, here, provider)
        return _replace_field(cls, head, target, _merge(target, here, section, provider, owners))
    if not rest:
        if head in cls.model_fields:
            owner = owners.get(here, "prime-core")
            raise PluginError(f"config key '{here}' is defined by both {owner} and plugin '{provider}'")
        owners[here] = f"plugin '{provider}'"
        info = FieldInfo(default=None, description=section.description or section.model.__doc__)
        return create_model(cls.__name__, __base__=cls, __doc__=cls.__doc__,
                            **{head: (Toggle[section.model], info)})
    target = _model_in(cls, head, here, provider)
    extended = _mount(target, rest, section, provider, owners, prefix=f"{here}.")
    return _replace_field(cls, head, target, extended)


def _model_in(cls: type[BaseModel], name: str, path: str, provider: str) -> type[BaseModel]:
    if name not in cls.model_fields:
        raise PluginError(f"plugin '{provider}' mounts a config section under '{path}', which does not exist")
    models = [m for m in _models_in(cls.model_fields[name].annotation)]
    if len(models) != 1:
        raise PluginError(f"plugin '{provider}' mounts a config section under '{path}', which is not a section")
    return models[0]


def _replace_field(cls: type[BaseModel], name: str, old: type, new: type) -> type[BaseModel]:
    info = copy.copy(cls.model_fields[name])
    info.annotation = _swap(info.annotation, old, new)
    if info.default_factory is not None:
        factory = info.default_factory
        info.default_factory = lambda: _upgrade(factory(), old, new)
    elif isinstance(info.default, old):
        default = info.default
        info.default = PydanticUndefined
        info.default_factory = lambda: _upgrade(default, old, new)
    return create_model(cls.__name__, __base__=cls, __doc__=cls.__doc__, **{name: (info.annotation, info)})


def _upgrade(value: Any, old: type, new: type) -> Any:
    """A default built as the core's class, re-validated as the extended class."""
    if isinstance(value, old) and not isinstance(value, new):
        return new.model_validate(value.model_dump(exclude_unset=True))
    return value


def _swap(annotation: Any, old: type, new: type) -> Any:
    if annotation is old:
        return new
    origin = get_origin(annotation)
    if origin is Annotated:
        inner, *meta = get_args(annotation)
        return Annotated[(_swap(inner, old, new), *meta)]
    if origin in (Union, types.UnionType):
        return Union[tuple(_swap(a, old, new) for a in get_args(annotation))]  # noqa: UP007
    if origin is list:
        return list[_swap(get_args(annotation)[0], old, new)]
    return annotation


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The BaseModel classes an annotation can hold (through Optional, Annotated, list, Union)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = get_origin(annotation)
    if origin is Annotated:
        return _models_in(get_args(annotation)[0])
    if origin in (Union, types.UnionType, list, dict, tuple) or origin is typing.Literal:
        out: list[type[BaseModel]] = []
        for arg in get_args(annotation):
            out.extend(_models_in(arg))
        return out
    return []


def model_at(root: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model class found by walking ``loc`` (a pydantic error location) from ``root``.

    Understands list indices and the tag that pydantic inserts for discriminated unions.
    """
    current: type[BaseModel] | None = root
    pending: list[type[BaseModel]] = []  # union members waiting for a tag
    for part in loc:
        if pending:
            tagged = [m for m in pending if _tag(m) == part]
            if tagged:
                current, pending = tagged[0], []
                continue
            current, pending = (pending[0] if len(pending) == 1 else None), []
        if current is None:
            return None
        if isinstance(part, int):
            continue
        field = current.model_fields.get(part) or _by_alias(current, part)
        if field is None:
            return None
        models = _models_in(field.annotation)
        if len(models) == 1:
            current = models[0]
        elif models:
            current, pending = None, models
        else:
            current = None
    if pending:
        return pending[0] if len(pending) == 1 else None
    return current


def _tag(model: type[BaseModel]) -> Any:
    field = model.model_fields.get("type")
    return field.default if field is not None else None


def _by_alias(model: type[BaseModel], name: str) -> FieldInfo | None:
    for info in model.model_fields.values():
        choices = getattr(info.validation_alias, "choices", None) or []
        if name in choices:
            return info
    return None


def field_names(model: type[BaseModel]) -> set[str]:
    names = set(model.model_fields)
    for info in model.model_fields.values():
        names.update(c for c in getattr(info.validation_alias, "choices", None) or [] if isinstance(c, str))
    return names


def all_paths(root: type[BaseModel], prefix: str = "", depth: int = 0) -> list[str]:
    """Every dotted key path of a schema (for 'did you mean' across sections)."""
    out: list[str] = []
    if depth > 6:
        return out
    for name, info in root.model_fields.items():
        path = f"{prefix}{name}"
        out.append(path)
        for sub in _models_in(info.annotation):
            out.extend(all_paths(sub, f"{path}.", depth + 1))
    return sorted(set(out))
