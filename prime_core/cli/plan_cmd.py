"""``prime plan CONFIG...``: predicted peak memory per trainer GPU, before anything starts."""

from __future__ import annotations

import typer

from prime_core.cli.common import CONFIG_ARGS, CONFIG_USAGE, config_epilog, load_config


def _launch_plan(config, root: str, manager):
    """The launcher's plan (where the trainer's GPUs are), or ``None`` when it cannot be made
    here (a script for a cluster, or a config the launcher refuses)."""
    from prime_core.config.checks import resolve_launcher
    from prime_core.errors import PrimeError
    from prime_core.launch.plan import role_config_paths

    try:
        launcher = manager.select("launchers", resolve_launcher(config, manager), key="launcher")
        paths = role_config_paths(config, config.output_dir, root)
        return launcher.plan(config, output_dir=config.output_dir, configs=paths, root=root)
    except PrimeError:
        return None


def register(app: typer.Typer) -> None:
    @app.command("plan", context_settings=CONFIG_ARGS, options_metavar=CONFIG_USAGE, epilog=config_epilog("rl"),
                 help="Predict the peak memory of each trainer GPU, and whether it fits, before launch.\n\n"
                      "From CONFIG... and --KEY VALUE overrides, as prime run takes them: parameters, gradients, "
                      "optimizer state, activations, LM head and buffers, and what is kept in host memory (this "
                      "machine). Nothing is loaded or started: the model is built on the meta device.")
    def plan_command(
        ctx: typer.Context,
        root: str = typer.Option("rl", "--root", help="Which config: rl (prime run), sft or trainer."),
        gpu_memory: float = typer.Option(None, "--gpu-memory", metavar="GIB",
                                         help="Compare with GPUs of this size (default: the trainer's placed GPUs, "
                                              "from nvidia-smi)."),
        host_memory: float = typer.Option(None, "--host-memory", metavar="GIB",
                                          help="Compare host memory terms with a machine of this size (default: "
                                               "this one)."),
    ) -> None:
        from prime_core.errors import ConfigError
        from prime_core.plan import show
        from prime_core.plugins import get_plugin_manager

        if root not in ("rl", "sft", "trainer"):
            raise typer.BadParameter(f"unknown root {root!r}: use rl, sft or trainer", param_hint="--root")
        manager = get_plugin_manager()
        config = load_config(root, ctx.args, manager)
        if getattr(config, "deployment", None) is None and root != "trainer":
            raise ConfigError([f"this {root} config has no deployment section"])
        plan = _launch_plan(config, root, manager) if gpu_memory is None else None
        show(config, root, gpu_memory_gib=gpu_memory, host_memory_gib=host_memory, plan=plan)
