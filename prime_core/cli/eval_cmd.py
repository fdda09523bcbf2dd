"""``prime eval CONFIG``: evaluate a model folder, or a running server, on the eval environments."""

from __future__ import annotations

import typer

from prime_core.cli.common import CONFIG_ARGS, CONFIG_USAGE, config_epilog


def register(app: typer.Typer) -> None:
    @app.command("eval", context_settings=CONFIG_ARGS, options_metavar=CONFIG_USAGE, epilog=config_epilog("rl"),
                 help="Evaluate a model on the environments of \\[orchestrator.eval] (avg@k, pass@k).\n\n"
                      "model.name is served by the \\[inference] table while the eval runs, or with --no-inference "
                      "the servers at orchestrator.client.base_url are asked. Writes output_dir/eval/results.json; "
                      "--dry-run says what it would evaluate and starts nothing.")
    def eval_command(ctx: typer.Context) -> None:
        from prime_core.cli.common import load_config
        from prime_core.hub import default_offline
        from prime_core.orchestrator.eval_run import run_standalone
        from prime_core.plugins import get_plugin_manager

        default_offline()
        config = load_config("rl", ctx.args)
        get_plugin_manager().hook.prime_configure(config=config, role="eval")
        code = run_standalone(config)
        if code:
            raise typer.Exit(code)
