"""``prime trainer|orchestrator|inference|sft CONFIG``: run one role by itself, as a
launcher does and as a user can by hand in a tmux pane.

``sft`` and ``inference`` are also roots: typed by a user they go through a launcher like
``prime run`` (``--dry-run``, ``[slurm]``, ``launcher = "torchrun"``, several GPUs); in a
process a launcher started (``PRIME_ROLE_PROCESS=1``, or a torchrun rank) they run the loop.
"""

from __future__ import annotations

import typer

from prime_core import distributed
from prime_core.cli.common import CONFIG_ARGS, CONFIG_USAGE, config_epilog, load_config, run_switches

ROLE_HELP = {
    "trainer": "Train on the batches the orchestrator writes; publish weights.",
    "orchestrator": "Sample from inference, score, and write training batches.",
    "inference": "Serve the policy (OpenAI-compatible API with weight updates).",
    "sft": "Supervised fine-tuning on a chat dataset (a local JSONL file or a Hugging Face dataset).",
}
ROLE_SWITCHES = {
    "sft": run_switches("times a few steps on fake data"),
    "inference": "--dry-run writes the resolved config and the launch plan and starts nothing.\n\n",
}
LAUNCHED_ROOTS = ("sft", "inference")
"""Roles that are also roots of a launch (``prime sft``, ``prime inference``)."""


def run_role(role: str, tokens: list[str]) -> int:
    """Load ``role``'s config and run its loop (``prime_core.<role>.role:run``)."""
    import importlib

    from prime_core.hub import default_offline
    from prime_core.launch.lifeline import watch_launcher
    from prime_core.plugins import get_plugin_manager

    watch_launcher()  # started by a launcher: end with it, whatever ends it
    default_offline()
    config = load_config(role, tokens, environ=_role_environ(role))
    if getattr(config, "log", None) is not None:
        import logging

        logging.basicConfig(level=config.log.level.upper(), format=f"%(asctime)s {role} %(levelname)s %(message)s")
    from prime_core.run_lock import lock_role

    lock = lock_role(config, role)  # by hand: one trainer (orchestrator, sft) per output_dir, no launch beside it
    failed = True
    try:
        get_plugin_manager().hook.prime_configure(config=config, role=role)
        code = importlib.import_module(f"prime_core.{role}.role").run(config)
        failed = False
        return code
    finally:
        if lock is not None:
            lock.release(remove_created=failed)  # a role refused at start leaves no trace


def _role_environ(role: str) -> dict[str, str] | None:
    """A role process's config is the file its launcher wrote, whole: the launcher resolved the
    ``PRIME_*`` variables into it, and reading them again here would change it behind the
    written file's back. A role typed by hand reads them like any command."""
    import os

    from prime_core.config.checks import schema_for
    from prime_core.config.load import config_variables
    from prime_core.launch.plan import is_role_process

    if not is_role_process():
        return None
    skipped = config_variables(os.environ, set(schema_for(role).model_fields))
    if skipped:
        print(f"{role}: not reading {', '.join(skipped)}: this role's config file already holds what its launcher "
              "resolved", flush=True)
    return {}


def _command(role: str, help_text: str):
    def command(ctx: typer.Context) -> None:
        from prime_core.launch.plan import is_role_process

        if role in LAUNCHED_ROOTS and not is_role_process():
            from prime_core.cli.run_cmd import launch

            code = launch(role, ctx.args)
            if code:
                raise typer.Exit(code)
            return
        if "--dry-run" in ctx.args:
            from prime_core.errors import UsageError

            raise UsageError(f"prime {role} has no --dry-run: it runs the role itself",
                             hint=f"`prime config validate --root {role} CONFIG` checks its config; `prime run CONFIG "
                                  "--dry-run` writes every role's config and the launch plan, starting nothing")
        code = run_role(role, ctx.args)
        if distributed.from_env()[2] > 1:  # a torchrun rank (trainer, sft): see exit_process
            distributed.exit_process(code)
        if code:
            raise typer.Exit(code)

    command.__doc__ = f"{help_text} From CONFIG... and --KEY VALUE overrides."
    return command


def register(app: typer.Typer) -> None:
    for role, help_text in ROLE_HELP.items():
        app.command(role, context_settings=CONFIG_ARGS, options_metavar=CONFIG_USAGE,
                    epilog=config_epilog(role, ROLE_SWITCHES.get(role, "")))(_command(role, help_text))
