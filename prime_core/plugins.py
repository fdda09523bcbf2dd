"""Discovering, checking and querying plugins.

Plugins are found through the entry-point group ``prime.plugins``; the entry-point name is
the plugin's short name (``deepep``), used everywhere a user names a plugin. Loading is
isolated per plugin: one that fails to import, targets another plugin API, or implements a
hook this core does not know is recorded as failed with the reason and skipped, and the rest
load. A run only stops when its config needs something a failed or disabled plugin would
have provided; the error then names that plugin and the fix.

Controls (environment variables are inherited by every role process a launcher starts):

- ``PRIME_DISABLED_PLUGINS=a,b`` or ``prime --disable-plugin a``: do not load these.
- ``PRIME_DISABLE_PLUGIN_AUTOLOAD=1``: load no entry points at all (tests).
- ``PRIME_DEBUG_PLUGINS=1``: keep the full traceback of a failed plugin.
- ``PRIME_TRACE_PLUGINS=1``: print every hook call with its plugins and results.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import sys
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import pluggy

from prime_core import ENTRY_POINT_GROUP, PLUGIN_API_VERSION, PROJECT, hookspecs, specs
from prime_core.errors import PluginError, did_you_mean

DISABLED_ENV = "PRIME_DISABLED_PLUGINS"
NO_AUTOLOAD_ENV = "PRIME_DISABLE_PLUGIN_AUTOLOAD"
DEBUG_ENV = "PRIME_DEBUG_PLUGINS"
TRACE_ENV = "PRIME_TRACE_PLUGINS"
CONTROL_ENV = (DISABLED_ENV, NO_AUTOLOAD_ENV, DEBUG_ENV, TRACE_ENV)


@dataclass(frozen=True)
class Registry:
    """A registry hook: which hook fills it, the spec type it holds, and what to call an entry."""

    hook: str
    spec: type[specs.Spec]
    noun: str


REGISTRIES: dict[str, Registry] = {
    "config_sections": Registry("prime_config_sections", specs.ConfigSection, "config section"),
    "model_impls": Registry("prime_model_impls", specs.ModelImpl, "model implementation"),
    "parallel_strategies": Registry("prime_parallel_strategies", specs.ParallelStrategy, "parallel strategy"),
    "ep_backends": Registry("prime_ep_backends", specs.EPBackend, "expert-parallel backend"),
    "kernels": Registry("prime_kernels", specs.Kernel, "kernel"),
    "inference_backends": Registry("prime_inference_backends", specs.InferenceBackend, "inference backend"),
    "routers": Registry("prime_routers", specs.Router, "router"),
    "launchers": Registry("prime_launchers", specs.Launcher, "launcher"),
    "environments": Registry("prime_environments", specs.Environment, "environment"),
    "tool_parsers": Registry("prime_tool_parsers", specs.ToolParser, "tool parser"),
    "weight_transports": Registry("prime_weight_transports", specs.WeightTransport, "weight transport"),
    "algorithms": Registry("prime_algorithms", specs.Algorithm, "algorithm"),
    "monitors": Registry("prime_monitors", specs.Monitor, "monitor"),
    "cli_commands": Registry("prime_cli_commands", specs.CliCommand, "CLI command"),
}

Status = Literal["active", "unavailable", "failed", "disabled"]


@dataclass
class PluginRecord:
    """What the core knows about one plugin, loaded or not."""

    name: str
    dist: str | None = None
    version: str | None = None
    status: Status = "active"
    reason: str | None = None
    plugin: Any = field(default=None, repr=False)
    provides: dict[str, list[specs.Spec]] = field(default_factory=dict, repr=False)

    @property
    def label(self) -> str:
        """``name (dist version)`` for messages."""
        if self.dist:
            return f"'{self.name}' ({self.dist} {self.version})"
        return f"'{self.name}'"


@dataclass(frozen=True)
class Provided:
    spec: specs.Spec
    plugin: str


def disabled_from_env() -> set[str]:
    return {n.strip() for n in os.environ.get(DISABLED_ENV, "").split(",") if n.strip()}


def _api_problem(obj: Any) -> str | None:
    declared = getattr(obj, "PRIME_PLUGIN_API", None)
    if declared is None:
        return (
            f"does not declare PRIME_PLUGIN_API; this prime-core speaks plugin API "
            f"{PLUGIN_API_VERSION} (add `PRIME_PLUGIN_API = {PLUGIN_API_VERSION}` to the plugin module)"
        )
    if not isinstance(declared, int) or declared != PLUGIN_API_VERSION:
        return (
            f"was built for plugin API {declared!r} but this prime-core speaks API "
            f"{PLUGIN_API_VERSION}: install a version of the plugin built for this prime-core "
            "(or upgrade prime-core)"
        )
    return None


class PluginManager:
    """The core's view of the installed plugins. One per process (``get_plugin_manager``)."""

    def __init__(self, *, autoload: bool | None = None, disabled: Iterable[str] | None = None) -> None:
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.records: dict[str, PluginRecord] = {}
        self.disabled = set(disabled) if disabled is not None else disabled_from_env()
        self._registries: dict[str, dict[str, Provided]] = {}
        self._aliases: dict[str, dict[str, str]] = {}
        self._loaded = False
        self.autoload = autoload if autoload is not None else os.environ.get(NO_AUTOLOAD_ENV, "") in ("", "0")
        if os.environ.get(TRACE_ENV, "") not in ("", "0"):
            self._enable_trace()

    # ---------------------------------------------------------------- loading

    def load(self) -> PluginManager:
        """Load every ``prime.plugins`` entry point once; failures are recorded, not raised."""
        if self._loaded:
            return self
        self._loaded = True
        if not self.autoload:
            return self
        seen: dict[str, str] = {}
        for ep in sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: (e.name, e.value)):
            dist = ep.dist.name if ep.dist else None
            version = ep.dist.version if ep.dist else None
            record = PluginRecord(name=ep.name, dist=dist, version=version)
            if ep.name in seen:
                # Two distributions claim one plugin name: keep neither silently winning.
                record.status, record.reason = "failed", (
                    f"plugin name '{ep.name}' is also registered by {seen[ep.name]}; "
                    "uninstall one of the two distributions"
                )
                self.records[f"{ep.name}@{dist}"] = record
                continue
            seen[ep.name] = f"{dist} {version}"
            if ep.name in self.disabled:
                record.status, record.reason = "disabled", f"disabled by {DISABLED_ENV} or --disable-plugin"
                self.records[ep.name] = record
                continue
            try:
                obj = ep.load()
            except BaseException as exc:  # noqa: BLE001 - a plugin may raise anything on import
                if isinstance(exc, KeyboardInterrupt):
                    raise
                record.status, record.reason = "failed", self._describe(exc, f"import of {ep.value} failed")
                self.records[ep.name] = record
                continue
            if isinstance(obj, type):
                obj = obj()
            self._add(record, obj, check_api=True)
        return self

    def register(self, obj: Any, name: str | None = None, *, dist: str | None = None,
                 version: str | None = None, check_api: bool = False) -> PluginRecord:
        """Register a plugin object in-process (tests, notebooks). Checks it like a loaded one."""
        name = name or getattr(obj, "__name__", None) or type(obj).__name__
        if name in self.records and self.records[name].status == "active":
            raise PluginError(f"a plugin named '{name}' is already registered")
        record = PluginRecord(name=name, dist=dist, version=version)
        self._add(record, obj, check_api=check_api)
        if record.status == "failed":
            raise PluginError(f"plugin {record.label} {record.reason}")
        return record

    def unregister(self, name: str) -> None:
        record = self.records.pop(name, None)
        if record is not None and record.plugin is not None and self.pm.is_registered(record.plugin):
            self.pm.unregister(record.plugin)
        self._registries.clear()
        self._aliases.clear()

    def _add(self, record: PluginRecord, obj: Any, *, check_api: bool) -> None:
        self.records[record.name] = record
        record.plugin = obj
        problem = _api_problem(obj) if check_api else None
        if problem:
            record.status, record.reason = "failed", problem
            return
        try:
            self.pm.register(obj, name=record.name)
        except Exception as exc:  # pluggy.PluginValidationError: an impl's args don't match its spec
            record.status, record.reason = "failed", self._describe(exc, "does not match the hook specs")
            return
        unknown = sorted(
            hc.name for hc in (self.pm.get_hookcallers(obj) or []) if not hc.has_spec()
        )
        if unknown:
            self.pm.unregister(obj)
            record.status = "failed"
            record.reason = (
                f"implements hooks this prime-core does not define: {', '.join(unknown)}"
                f"{did_you_mean(unknown[0], (r.hook for r in REGISTRIES.values()))}"
            )
            return
        self._registries.clear()
        self._aliases.clear()

    @staticmethod
    def _describe(exc: BaseException, what: str) -> str:
        text = f"{what}: {type(exc).__name__}: {exc}"
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            text += "\n" + "".join(traceback.format_exception(exc))
        return text

    def _enable_trace(self) -> None:
        def before(hook_name, impls, kwargs):
            print(f"[prime trace] {hook_name}({', '.join(kwargs)}) -> {[i.plugin_name for i in impls]}",
                  file=sys.stderr)

        def after(outcome, hook_name, impls, kwargs):
            print(f"[prime trace] {hook_name} returned {outcome.get_result()!r}", file=sys.stderr)

        self.pm.add_hookcall_monitoring(before, after)

    # ---------------------------------------------------------------- registries

    @property
    def hook(self):
        """Call lifecycle hooks: ``manager.hook.prime_on_step_end(step=1, metrics={}, role="trainer")``."""
        self.load()
        return self.pm.hook

    def active(self) -> list[PluginRecord]:
        self.load()
        return [r for r in self.records.values() if r.status in ("active", "unavailable")]

    def registry(self, kind: str) -> dict[str, Provided]:
        """All specs of one registry, keyed by name, from every active plugin.

        Raises ``PluginError`` naming both providers when two plugins register one name.
        """
        if kind not in REGISTRIES:
            raise KeyError(f"unknown registry {kind!r}; known: {', '.join(REGISTRIES)}")
        self.load()
        if kind in self._registries:
            return self._registries[kind]
        reg = REGISTRIES[kind]
        found: dict[str, Provided] = {}
        for record in sorted(self.active(), key=lambda r: r.name):
            for spec in self._call_registry(record, reg):
                if spec.key in found:
                    other = self.records[found[spec.key].plugin]
                    raise PluginError(
                        f"{reg.noun} '{spec.key}' is provided by two plugins: {other.label} and "
                        f"{record.label}",
                        hint=f"uninstall one, or disable it with --disable-plugin {record.name}",
                    )
                found[spec.key] = Provided(spec, record.name)
        self._aliases[kind] = self._alias_map(reg, found)
        self._registries[kind] = dict(sorted(found.items()))
        return self._registries[kind]

    def _alias_map(self, reg: Registry, found: dict[str, Provided]) -> dict[str, str]:
        """``{alias key: key}``; an alias that is also a name or another spec's alias is refused
        as two providers of one name are, so that no alias silently shadows anything."""
        aliases: dict[str, str] = {}
        for key, provided in found.items():
            for alias in provided.spec.alias_keys:
                clash = key if alias == key else alias if alias in found else aliases.get(alias)
                if clash is None:
                    aliases[alias] = key
                    continue
                other = self.records[found[clash].plugin]
                raise PluginError(
                    f"{reg.noun} name '{alias}' is claimed twice: as an alias of '{key}' by "
                    f"{self.records[provided.plugin].label} and as "
                    f"{'the name' if alias == clash else 'an alias'} of '{clash}' by {other.label}",
                    hint=f"uninstall one, or disable it with --disable-plugin {provided.plugin}",
                )
        return aliases

    def resolve(self, kind: str, name: str) -> str:
        """The registered key ``name`` selects in registry ``kind``: ``name`` itself, or the key
        it is an alias of."""
        self.registry(kind)
        return self._aliases.get(kind, {}).get(name, name)

    def _call_registry(self, record: PluginRecord, reg: Registry) -> list[specs.Spec]:
        if reg.hook in record.provides:
            return record.provides[reg.hook]
        impl = getattr(record.plugin, reg.hook, None)
        if impl is None or not self.pm.is_registered(record.plugin):
            record.provides[reg.hook] = []
            return []
        try:
            result = list(impl() or [])
        except Exception as exc:
            record.status, record.reason = "failed", self._describe(exc, f"{reg.hook}() raised")
            record.provides[reg.hook] = []
            return []
        bad = [r for r in result if not isinstance(r, reg.spec)]
        if bad:
            record.status = "failed"
            record.reason = (
                f"{reg.hook}() must return {reg.spec.__name__} objects, got {type(bad[0]).__name__}"
            )
            record.provides[reg.hook] = []
            return []
        record.provides[reg.hook] = result
        return result

    def provided_by(self, record: PluginRecord) -> dict[str, list[specs.Spec]]:
        """What one plugin registers, by registry (fills ``record.provides``)."""
        if record.status in ("active", "unavailable"):
            for reg in REGISTRIES.values():
                self._call_registry(record, reg)
        return {h: s for h, s in record.provides.items() if s}

    def versions(self) -> dict[str, str]:
        """``{distribution: version}`` of prime-core and every active plugin: what a checkpoint
        or a published model records about the code that produced it."""
        from prime_core import __version__

        found = {"prime-core": __version__}
        for record in self.active():
            if record.dist:
                found[record.dist] = record.version or "unknown"
        return dict(sorted(found.items()))

    def status(self) -> list[PluginRecord]:
        """Every plugin with its final status; plugins whose capabilities all report a reason
        are ``unavailable`` (with the first reason)."""
        self.load()
        for record in self.records.values():
            # Config sections and commands are not capabilities: a plugin whose capabilities
            # all cannot run here is unavailable, whatever keys or commands it adds.
            provided = [s for ss in self.provided_by(record).values() for s in ss
                        if not isinstance(s, specs.ConfigSection | specs.CliCommand)]
            checked = [s for s in provided if s.checks_availability]
            if record.status == "active" and checked and len(checked) == len(provided):
                reasons = [s.unavailable_reason() for s in checked]
                if all(reasons):
                    record.status, record.reason = "unavailable", reasons[0]
        return sorted(self.records.values(), key=lambda r: r.name)

    # ---------------------------------------------------------------- selection

    def select(self, kind: str, name: str, *, key: str | None = None, shown: str | None = None) -> specs.Spec:
        """The spec registered as ``name`` in registry ``kind``, usable on this machine.

        ``key`` is the config key that asked for it and ``shown`` the value as the user wrote
        it (without a registry prefix such as ``loss:``); both only shape the error message.
        """
        reg = REGISTRIES[kind]
        entries = self.registry(kind)
        where = f"{key} = '{shown or name}'" if key else f"{reg.noun} '{name}'"
        name = self.resolve(kind, name)
        if name in entries:
            reason = entries[name].spec.unavailable_reason()
            if reason:
                raise PluginError(
                    f"{where}: the {reg.noun} '{name}' from plugin "
                    f"{self.records[entries[name].plugin].label} cannot run here: {reason}"
                )
            return entries[name].spec
        available = ", ".join(entries) or "none"
        article = "an" if reg.noun[0] in "aeiou" else "a"
        message = f"{where}: no installed plugin provides {article} {reg.noun} named '{name}'" + did_you_mean(
            name, [*entries, *self._aliases.get(kind, {})]
        )
        hint = self._inactive_hint(name) or self._owner_hint(kind, name)
        raise PluginError(
            f"{message}. Available: {available}",
            hint=hint or "run `prime plugins list` to see what is installed",
        )

    def _owner_hint(self, kind: str, name: str) -> str | None:
        from prime_core.plugin_index import name_owner, owner_hint

        entry = name_owner(kind, name)
        why = owner_hint(entry, self) if entry else None
        return f"it is provided by {why}" if why else None

    def _inactive_hint(self, name: str) -> str | None:
        """If a disabled or failed plugin might have provided ``name``, say which and why."""
        stem = name.split(":")[-1].replace("-", "_")
        for record in self.records.values():
            if record.status in ("disabled", "failed") and record.name.replace("-", "_") in (stem, name):
                if record.status == "disabled":
                    return f"plugin {record.label} is disabled; remove it from {DISABLED_ENV} / --disable-plugin"
                return f"plugin {record.label} failed to load: {record.reason}"
        return None


_MANAGER: PluginManager | None = None


def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager, loaded on first use."""
    global _MANAGER
    if _MANAGER is None:
        _MANAGER = PluginManager()
    return _MANAGER.load()


def set_plugin_manager(manager: PluginManager | None) -> None:
    """Replace (or with ``None``, forget) the process-wide manager; used by tests and the CLI."""
    global _MANAGER
    _MANAGER = manager



def version_changes(recorded: dict[str, str], current: dict[str, str]) -> list[str]:
    """What differs between two ``versions()`` records, one line per distribution."""
    changes = []
    for dist in sorted(set(recorded) | set(current)):
        old, new = recorded.get(dist), current.get(dist)
        if old == new:
            continue
        if old is None:
            changes.append(f"{dist} {new} was not used before")
        elif new is None:
            changes.append(f"{dist} {old} is no longer active")
        else:
            changes.append(f"{dist} {old} -> {new}")
    return changes
