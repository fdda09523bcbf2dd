"""``prime config show|keys|validate``."""

from __future__ import annotations

import json

import typer

from prime_core.cli.common import CONFIG_ARGS, load_config, load_config_and_sources

ROOT_HELP = "Which config: rl (prime run), sft, trainer, orchestrator or inference."


def _without_none(value):
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_none(v) for v in value]
    return value


def render(config, fmt: str) -> str:
    data = config.model_dump(mode="json")
    if fmt == "json":
        return json.dumps(data, indent=2)
    if fmt == "yaml":
        import yaml

        return yaml.safe_dump(data, sort_keys=False)
    import tomli_w

    return tomli_w.dumps(_without_none(data))  # TOML has no null: unset keys are left out


def register(app: typer.Typer) -> None:
    config_app = typer.Typer(help="Show or check a resolved config.", no_args_is_help=True)
    app.add_typer(config_app, name="config")

    @config_app.command("show", context_settings=CONFIG_ARGS)
    def show(
        ctx: typer.Context,
        root: str = typer.Option("rl", "--root", help=ROOT_HELP),
        fmt: str = typer.Option("toml", "--format", help="toml, yaml or json."),
    ) -> None:
        """Print the config that FILES... and --key value overrides resolve to."""
        if fmt not in ("toml", "yaml", "json"):
            raise typer.BadParameter(f"unknown format {fmt!r}: use toml, yaml or json", param_hint="--format")
        typer.echo(render(load_config(_root(root), ctx.args), fmt))

    @config_app.command("keys")
    def keys(
        prefixes: list[str] = typer.Argument(None, metavar="PREFIX",
                                             help="Only the keys under these (trainer.optim, orchestrator.sampling)."),
        root: str = typer.Option("rl", "--root", help=ROOT_HELP),
    ) -> None:
        """Every key of a config (the installed plugins' sections too), its default and what it
        does; --key.name value (or key = value in a file) sets it."""
        lines = key_lines(load_config(_root(root), []), prefixes or [])
        if not lines:
            raise typer.BadParameter(f"no key of the {root} config starts with {', '.join(prefixes)}",
                                     param_hint="PREFIX")
        typer.echo("\n".join(lines))

    @config_app.command("validate", context_settings=CONFIG_ARGS)
    def validate(ctx: typer.Context, root: str = typer.Option("rl", "--root", help=ROOT_HELP)) -> None:
        """Check a config: schema, and that installed plugins provide all it selects."""
        from prime_core.config.checks import check
        from prime_core.config.report import with_sources
        from prime_core.errors import ConfigError

        config, sources = load_config_and_sources(_root(root), ctx.args)
        problems = check(config, _root(root))
        if problems:
            raise ConfigError(with_sources(problems, sources))
        typer.echo("config is valid")


def key_lines(config, prefixes: list[str]) -> list[str]:
    """``key = default`` and the first sentence of what the key does, for every key of ``config``
    under one of ``prefixes`` (every key when none)."""
    from pydantic import BaseModel

    from prime_core.config.base import walk_fields

    wanted = [p.replace("-", "_").strip(".") for p in prefixes]
    lines = []
    for key, value, info, _ in walk_fields(config):
        if isinstance(value, BaseModel) or (wanted and not any(key == p or key.startswith(f"{p}.") for p in wanted)):
            continue
        shown = json.dumps([v.model_dump(mode="json") if isinstance(v, BaseModel) else v for v in value]
                           if isinstance(value, list) else value, default=str)
        lines.append(f"{key} = {shown}")
        about = " ".join((info.description or "").split())
        if about:
            lines.append(f"    {about.split('. ')[0].rstrip('.').replace('``', '`')}.")
    return lines


def _root(root: str) -> str:
    from prime_core.config.schema import BASE_ROOTS

    if root not in BASE_ROOTS:
        raise typer.BadParameter(f"unknown root {root!r}: use one of {', '.join(BASE_ROOTS)}", param_hint="--root")
    return root
