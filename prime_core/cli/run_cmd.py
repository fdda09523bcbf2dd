"""``prime run CONFIG...`` (and ``prime sft`` / ``prime inference`` when typed by a user):
validate, write the resolved configs, plan with the selected launcher, print the placement,
write the plan, then launch (or stop there with ``--dry-run``).

The launcher gets the root config whatever the root is (``rl``, ``sft``, ``inference``), so
a plugin's ``prime_select_launcher`` (``[slurm]``, ``[torchrun]``) decides for all three.
"""

from __future__ import annotations

import typer

from prime_core.cli.common import (
    CONFIG_ARGS,
    CONFIG_USAGE,
    config_epilog,
    load_config_and_sources,
    print_warning,
    run_switches,
)


def launch(root: str, tokens: list[str]) -> int:
    """The launch path shared by ``prime run`` (root ``rl``), ``prime sft`` and ``prime inference``."""
    from rich.console import Console

    from prime_core.config.checks import check, hub_problems, resolve_launcher
    from prime_core.config.report import with_sources
    from prime_core.errors import ConfigError, PrimeError
    from prime_core.launch.plan import role_config_paths
    from prime_core.plugins import get_plugin_manager
    from prime_core.run_lock import OutputDirLock, check_output_dir

    manager = get_plugin_manager()
    config, sources = load_config_and_sources(root, tokens, manager)
    dry_run = bool(getattr(config, "dry_run", False))
    problems = with_sources(check(config, root, manager, here=False), sources)
    if problems and not dry_run:
        raise ConfigError(problems, source="this run cannot start")
    console = Console(highlight=False)
    paths = role_config_paths(config, config.output_dir, root)
    if getattr(config, "bench", None):  # the trainer benchmarks on fake data; nothing else is needed
        paths = {role: path for role, path in paths.items()
                 if role not in ("inference", "orchestrator", "teacher_inference")}
    try:
        launcher = manager.select("launchers", resolve_launcher(config, manager), key="launcher")
    except PrimeError:
        launcher = None  # already among the problems, reported below
    plan = None
    if launcher is not None:
        plan = launcher.plan(config, output_dir=config.output_dir, configs=paths, root=root)
    if plan is not None and "teacher_inference" in paths and not any(
            p.role == "teacher_inference" for p in plan.processes):
        problems = [*problems, f"teacher_inference: the '{plan.launcher}' launcher does not start a teacher server; "
                               "run the teacher yourself and set orchestrator.teacher.client.base_url (without "
                               "teacher_inference), or use the local launcher"]
        if not dry_run:
            raise ConfigError(problems, source="this run cannot start")
    if plan is not None and plan.script is None:  # the roles run on this machine, with its model cache
        here = with_sources(hub_problems(config), sources)
        if here and not dry_run:
            raise ConfigError(here, source="this run cannot start")
        problems = [*problems, *here]
    check_output_dir(config.output_dir)
    owner = plan is None or not plan.node_rank  # node 0 owns output_dir; the other nodes join its run
    _refuse_output_dir(config, root, dry_run, owner)  # before the lock: a refused run leaves no trace
    # Held until this process ends (the roles it starts die with it): a second run, a --resume
    # or a --clean on this folder is refused before anything in it is deleted or written.
    lock = OutputDirLock(config.output_dir).acquire() if owner else None
    written = False
    try:
        problem = _refuse_output_dir(config, root, dry_run, owner)  # again, now that no one else can change it
        if lock is not None and lock.took_over:
            console.print(f"note: {config.output_dir} was left locked by a run that did not end cleanly "
                          f"({lock.took_over}); taken over", markup=False)
        if owner and not dry_run:
            clean_output_dir(config, root)
        written = True
        if problem:
            problems = [*problems, str(problem)]
        return _write_and_launch(config, root, paths, plan, launcher, console, problems, dry_run, manager)
    finally:
        if lock is not None:
            lock.release(remove_created=not written)  # a refused run leaves the disk as it was


def _refuse_output_dir(config, root: str, dry_run: bool, owner: bool):
    """Raise the ``output_dir_problem`` that stops this run (a dry run is only stopped by a
    previous run, whose configs/ it would overwrite); return one a dry run only reports."""
    problem = output_dir_problem(config, root) if owner else None
    if problem and (not dry_run or problem.previous_run):
        raise problem
    return problem


def _write_and_launch(config, root, paths, plan, launcher, console, problems, dry_run, manager) -> int:
    from prime_core.launch.plan import write_plan, write_role_configs

    write_role_configs(config, config.output_dir, root)
    console.print(f"resolved configs written to {paths[root].parent}", markup=False)
    if plan is not None:
        write_plan(plan)
        show_plan(plan, console)
        if root in ("rl", "sft"):
            from prime_core.plan import warn_before_launch

            warn_before_launch(config, root, plan, print_warning)  # only where the trainer's GPUs are here
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
            table.add_column(column, overflow="fold")
        for row in plan.placement:
            table.add_row(*(str(row.get(column, "")) for column in columns))
        console.print(table)
    for process in plan.processes:
        console.print(f"  {process.role:<13} {process.shell()}", markup=False)
    for note in plan.notes:
        console.print(f"  note: {note}", markup=False)


RUN_OUTPUTS = {
    "rl": ("rollouts", "weights", "checkpoints", "logs", "metrics.jsonl", "metrics.superseded.jsonl",
           "metrics.torn.jsonl"),
    "sft": ("model", "checkpoints", "logs", "metrics.jsonl", "metrics.superseded.jsonl", "metrics.torn.jsonl"),
}
"""What a run of each root writes under ``output_dir`` (and ``--clean`` deletes)."""


def output_dir_problem(config, root: str):
    """Why this run must not start on its ``output_dir`` as it is (a ``PrimeError``), or ``None``.

    A new run must not mix with an old one: refuse unless ``--clean`` or ``--resume``; a
    ``--resume`` needs something to resume. Only for roots with those switches."""
    from prime_core.errors import PrimeError

    if not hasattr(config, "clean") or getattr(config, "bench", None):  # a benchmark writes no run outputs
        return None
    out = config.output_dir
    # logs/ alone is no run to protect or resume (a start that failed, or another node of this
    # launch creating its log folder first); --clean removes it with the rest.
    previous = [name for name in RUN_OUTPUTS[root] if name != "logs" and (out / name).exists()]
    if config.resume and not previous:
        error = PrimeError(f"--resume: output_dir {out} holds no earlier run to continue (no "
                          f"{', '.join(RUN_OUTPUTS[root][:3])}, metrics.jsonl)",
                          hint="leave out --resume to start a new run, or point --output-dir at the run to continue")
        error.previous_run = False
        return error
    if previous and not (config.resume or config.clean):
        error = PrimeError(
            f"output_dir {out} holds a previous run ({', '.join(previous)}); nothing was changed",
            hint="--resume continues it, --clean deletes it, or choose another --output-dir",
        )
        error.previous_run = True
        return error
    return None


def clean_output_dir(config, root: str) -> None:
    """``--clean``: delete the previous run's outputs (under the lock, after every check)."""
    import shutil

    if not getattr(config, "clean", False):
        return
    out = config.output_dir
    for name in RUN_OUTPUTS[root]:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def register(app: typer.Typer) -> None:
    @app.command("run", context_settings=CONFIG_ARGS, options_metavar=CONFIG_USAGE,
                 epilog=config_epilog("rl", run_switches("times the trainer on fake data")))
    def run_command(ctx: typer.Context) -> None:
        """Run the RL stack (inference, orchestrator, trainer) from CONFIG... and --KEY VALUE overrides."""
        code = run(ctx.args)
        if code:
            raise typer.Exit(code)
