"""The ``prime`` command.

Built by ``build_app(manager)`` (no import-time registration, so tests build as many apps as
they like). Only typer and the plugin manager are imported to build it: pydantic, dynaconf,
torch and friends are imported inside the commands that need them, which keeps
``prime --help`` fast.
"""

from __future__ import annotations

import os
import sys

import typer
from typer.core import TyperGroup

from prime_core import __version__
from prime_core.cli.common import print_error, print_warning
from prime_core.errors import PrimeError
from prime_core.plugins import DISABLED_ENV, PluginManager, get_plugin_manager, set_plugin_manager

BUILTIN_COMMANDS = ("run", "plan", "config", "plugins", "plugin", "trainer", "orchestrator", "inference", "sft")


class PrimeGroup(TyperGroup):
    """Turns ``PrimeError`` anywhere below, and failed file writes (``storage_error``), into a
    message and its exit code, no traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except PrimeError as exc:
            print_error(exc)
            ctx.exit(exc.exit_code)
        except Exception as exc:  # a full disk or a forbidden folder: a message, not a traceback
            from prime_core.errors import storage_error

            friendly = storage_error(exc)
            if friendly is None:
                raise
            print_error(friendly)
            ctx.exit(friendly.exit_code)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"prime-core {__version__}")
        raise typer.Exit()


def build_app(manager: PluginManager | None = None) -> typer.Typer:
    """The ``prime`` app with the built-in commands and every plugin's ``prime_cli_commands``."""
    from prime_core.cli import config_cmd, eval_cmd, plan_cmd, plugins_cmd, roles, run_cmd

    manager = manager or get_plugin_manager()
    app = typer.Typer(
        name="prime",
        cls=PrimeGroup,
        help="Asynchronous RL and SFT post-training for LLMs. Start with `prime run CONFIG`.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )

    @app.callback()
    def _root(
        disable_plugin: list[str] = typer.Option(
            [], "--disable-plugin", metavar="NAME",
            help=f"Do not load this plugin (repeatable; also {DISABLED_ENV}=a,b).",
        ),
        version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                     help="Show the version and exit."),
    ) -> None:
        # --disable-plugin is applied before the app is built (see main); nothing to do here.
        pass

    run_cmd.register(app)
    plan_cmd.register(app)
    config_cmd.register(app)
    plugins_cmd.register(app)
    roles.register(app)
    eval_cmd.register(app)
    _add_plugin_commands(app, manager)
    return app


def _add_plugin_commands(app: typer.Typer, manager: PluginManager) -> None:
    try:
        entries = manager.registry("cli_commands")
    except PrimeError as exc:  # two plugins claim one command name
        manager.cli_conflicts = [str(exc)]
        return
    taken = set(BUILTIN_COMMANDS)
    groups: dict[tuple[str, ...], typer.Typer] = {(): app}
    conflicts = []
    for provided in sorted(entries.values(), key=lambda p: (len(p.spec.parent), p.spec.name)):
        spec = provided.spec
        parent = tuple(spec.parent)
        path = (*parent, spec.name)
        if parent not in groups:
            conflicts.append(f"plugin '{provided.plugin}': command {' '.join(path)}: no group '{' '.join(parent)}'")
            continue
        if not parent and spec.name in taken:
            conflicts.append(f"plugin '{provided.plugin}': command '{spec.name}' clashes with a built-in command")
            continue
        if isinstance(spec.app, typer.Typer):
            groups[parent].add_typer(spec.app, name=spec.name, help=spec.description or None)
            groups[path] = spec.app
        elif callable(spec.app):
            groups[parent].command(name=spec.name, help=spec.description or None)(spec.app)
        else:
            conflicts.append(f"plugin '{provided.plugin}': command '{spec.name}' is neither a typer.Typer nor callable")
    manager.cli_conflicts = conflicts


def _disabled_from_argv(argv: list[str]) -> list[str]:
    names = []
    for i, arg in enumerate(argv):
        if arg == "--disable-plugin" and i + 1 < len(argv):
            names.append(argv[i + 1])
        elif arg.startswith("--disable-plugin="):
            names.append(arg.split("=", 1)[1])
    return names


def _unknown_disabled(manager: PluginManager) -> PrimeError | None:
    """A name given to ``--disable-plugin`` (or ``PRIME_DISABLED_PLUGINS``) that no installed
    plugin has: a typo would otherwise leave the plugin meant running."""
    from importlib.metadata import entry_points

    from prime_core import ENTRY_POINT_GROUP
    from prime_core.errors import PluginError, did_you_mean

    if not manager.autoload:
        return None
    installed = {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    unknown = sorted(manager.disabled - installed)
    if not unknown:
        return None
    return PluginError(f"--disable-plugin / {DISABLED_ENV}: no installed plugin is named "
                       f"{', '.join(repr(n) for n in unknown)}{did_you_mean(unknown[0], installed)}",
                       hint="`prime plugins list` shows the installed plugins' names")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    disabled = _disabled_from_argv(argv)
    if disabled:
        # Through the environment, so that every role process a launcher starts agrees.
        current = [n for n in os.environ.get(DISABLED_ENV, "").split(",") if n]
        os.environ[DISABLED_ENV] = ",".join(dict.fromkeys(current + disabled))
        set_plugin_manager(None)
    manager = get_plugin_manager()
    unknown = _unknown_disabled(manager)
    if unknown:
        print_error(unknown)
        sys.exit(unknown.exit_code)
    if not argv or argv[0] != "plugins":
        for record in manager.records.values():
            if record.status == "failed":
                print_warning(f"plugin {record.label} failed to load and is skipped: "
                              f"{record.reason.splitlines()[0]} (see `prime plugins list`)")
    try:
        app = build_app(manager)
    except PrimeError as exc:
        print_error(exc)
        sys.exit(exc.exit_code)
    command = typer.main.get_command(app)
    command.main(args=argv, prog_name="prime", standalone_mode=True)


if __name__ == "__main__":
    main()
