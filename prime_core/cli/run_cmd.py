"""``prime run CONFIG...`` (and ``prime sft`` / ``prime inference`` when typed by a user):
validate, write the resolved configs, plan with the selected launcher, print the placement,
write the plan, then launch (or stop there with ``--dry-run``).

The launcher gets the root config whatever the root is (``rl``, ``sft``, ``inference``), so
a plugin's ``prime_select_launcher`` (``[slurm]``, ``[torchrun]``) decides for all three.
"""

from __future__ import annotations

import typer

from prime_core.cli.common import CONFIG_ARGS, load_config, print_warning


def launch(root: str, tokens: list[str]) -> int:
    """The launch path shared by ``prime run`` (root ``rl``), ``prime sft`` and ``prime inference``."""
    from rich.console import Console

    from prime_core.config.checks import check, resolve_launcher
    from prime_core.errors import ConfigError, PrimeError
    from prime_core.launch.plan import role_config_paths, write_plan, write_role_configs
    from prime_core.plugins import get_plugin_manager

    manager = get_plugin_manager()
    config = load_config(root, tokens, manager)
    dry_run = bool(getattr(config, "dry_run", False))
    problems = check(config, root, manager)
    if problems and not dry_run:
        raise ConfigError(problems, source="this run cannot start")
    console = Console(highlight=False)
    paths = role_config_paths(config, config.output_dir, root)
    if getattr(config, "bench", None):  # the trainer benchmarks on fake data; nothing else is needed
        paths = {role: path for role, path in paths.items() if role not in ("inference", "orchestrator")}
    try:
        launcher = manager.select("launchers", resolve_launcher(config, manager), key="launcher")
    except PrimeError:
        launcher = None  # already among the problems, reported below
    plan = None
    if launcher is not None:
        plan = launcher.plan(config, output_dir=config.output_dir, configs=paths, root=root)
    if not dry_run and not plan.node_rank:  # node 0 owns output_dir; the other nodes join its run
        prepare_output_dir(config)
    write_role_configs(config, config.output_dir, root)
    console.print(f"resolved configs written to {paths[root].parent}", markup=False)
    if plan is not None:
        write_plan(plan)
        show_plan(plan, console)
    if dry_run:
        for problem in problems:
            print_warning(f"a real run would stop here: {problem}")
        console.print("dry run: nothing started", markup=False)
        return 0
    if not plan.inline:  # an inline role calls prime_configure itself
        manager.hook.prime_configure(config=config, role="run")
    return launcher.launch(plan)


def run(tokens: list[str]) -> int:
    return launch("rl", tokens)


def show_plan(plan, console) -> None:
    """The placement table (what runs where), then each command as a user would type it."""
    if plan.placement:
        from rich.table import Table

        columns = list(dict.fromkeys(key for row in plan.placement for key in row))
        table = Table(title=f"placement ({plan.launcher} launcher)", title_justify="left")
        for column in columns:
            table.add_column(column)
        for row in plan.placement:
            table.add_row(*(str(row.get(column, "")) for column in columns))
        console.print(table)
    for process in plan.processes:
        console.print(f"  {process.role:<13} {process.shell()}", markup=False)
    for note in plan.notes:
        console.print(f"  note: {note}", markup=False)


RUN_OUTPUTS = ("rollouts", "weights", "checkpoints", "logs", "metrics.jsonl", "metrics.superseded.jsonl")


def prepare_output_dir(config) -> None:
    """A new run must not mix with an old one: refuse, clean (``--clean``) or resume (``--resume``).
    Only for roots that have those switches (``prime run``)."""
    import shutil

    from prime_core.errors import PrimeError

    if not hasattr(config, "clean"):
        return
    out = config.output_dir
    previous = [name for name in RUN_OUTPUTS if (out / name).exists()]
    if not previous or config.resume or config.bench:  # a benchmark writes no run outputs
        return
    if not config.clean:
        raise PrimeError(
            f"output_dir {out} holds a previous run ({', '.join(previous)})",
            hint="--resume continues it, --clean deletes it, or choose another --output-dir",
        )
    for name in previous:
        path = out / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def register(app: typer.Typer) -> None:
    @app.command("run", context_settings=CONFIG_ARGS)
    def run_command(ctx: typer.Context) -> None:
        """Run the RL stack. CONFIG... are files (a.toml b.yaml, or @ a.toml @ b.toml) and --key value overrides; --dry-run writes the resolved configs and the plan and starts nothing."""
        code = run(ctx.args)
        if code:
            raise typer.Exit(code)
