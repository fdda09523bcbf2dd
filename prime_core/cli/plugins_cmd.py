"""``prime plugins list`` and ``prime plugin new``."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from prime_core.plugins import REGISTRIES, PluginManager, get_plugin_manager
from prime_core.specs import ConfigSection

_NOUN_BY_HOOK = {reg.hook: kind for kind, reg in REGISTRIES.items()}


def describe(manager: PluginManager) -> list[dict]:
    """One dict per plugin: name, distribution, version, status, reason, provides."""
    rows = []
    for record in manager.status():
        provides = {}
        for hook, specs in manager.provided_by(record).items():
            provides[_NOUN_BY_HOOK[hook]] = [
                {"name": _label(s), "unavailable": s.unavailable_reason(), **({"aliases": list(s.aliases)}
                                                                           if s.aliases else {})} for s in specs
            ]
        hooks = sorted(
            hc.name for hc in (manager.pm.get_hookcallers(record.plugin) or [])
        ) if record.plugin is not None and manager.pm.is_registered(record.plugin) else []
        rows.append({
            "name": record.name,
            "distribution": record.dist,
            "version": record.version,
            "status": record.status,
            "reason": record.reason,
            "provides": provides,
            "hooks": hooks,
        })
    return rows


def _label(spec) -> str:
    """What a user recognises a spec by: its name, or for keys merged into a section, the keys."""
    if isinstance(spec, ConfigSection) and spec.merge:
        where = f"{spec.name}." if spec.name else ""
        return ", ".join(f"{where}{key}" for key in spec.model.model_fields) or f"{spec.name or 'root'} checks"
    return spec.key


def _provides_text(provides: dict) -> str:
    parts = []
    for kind, entries in provides.items():
        names = ", ".join(e["name"] + (f" (alias {', '.join(e['aliases'])})" if e.get("aliases") else "")
                          + (" (unavailable)" if e["unavailable"] else "") for e in entries)
        parts.append(f"{kind}: {names}")
    return "; ".join(parts) or "-"


def register(app: typer.Typer) -> None:
    plugins_app = typer.Typer(help="Inspect installed plugins.", no_args_is_help=True)
    app.add_typer(plugins_app, name="plugins")

    @plugins_app.command("list")
    def list_plugins(as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
        """Every plugin: distribution, version, what it provides, and whether it works here."""
        manager = get_plugin_manager()
        rows = describe(manager)
        conflicts = getattr(manager, "cli_conflicts", [])
        if as_json:
            typer.echo(json.dumps({"plugins": rows, "cli_conflicts": conflicts}, indent=2))
            return
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        table = Table(title="prime plugins", show_lines=False)
        for column in ("plugin", "distribution", "version", "status", "provides"):
            table.add_column(column, overflow="fold")
        styles = {"active": "green", "unavailable": "yellow", "failed": "red", "disabled": "dim"}
        for row in rows:
            status = row["status"] + (f": {row['reason'].splitlines()[0]}" if row["reason"] else "")
            table.add_row(row["name"], row["distribution"] or "-", row["version"] or "-",
                          Text(status, style=styles[row["status"]]), Text(_provides_text(row["provides"])))
        console = Console(soft_wrap=False)
        console.print(table)
        for conflict in conflicts:
            console.print(Text(f"skipped CLI command: {conflict}", style="yellow"))

    plugin_app = typer.Typer(help="Write new plugins.", no_args_is_help=True)
    app.add_typer(plugin_app, name="plugin")

    @plugin_app.command("new")
    def new_plugin(
        name: str = typer.Argument(..., help="Short plugin name, e.g. 'my-monitor'."),
        directory: Path = typer.Option(Path("."), "--dir", help="Where to create prime-plugin-NAME/."),
        kind: str = typer.Option("generic", "--kind", help="generic (a config section and a command), environment, "
                                 "monitor, launcher, kernel, model_impl, weight_transport or algorithm."),
    ) -> None:
        """Create an installable plugin from the template (pip install -e it, then `prime plugins list`)."""
        from prime_core.plugin_template import create_plugin

        path = create_plugin(name, directory, kind)
        typer.echo(f"created {path}\nnext: pip install -e {path} && prime plugins list && pytest {path / 'tests'}")
