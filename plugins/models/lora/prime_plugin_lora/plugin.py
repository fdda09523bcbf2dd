"""Hooks of prime-plugin-lora: the ``lora`` strategy (``adapters`` slot of the trainer's build
order), its ``trainer.model.lora`` key, and ``prime lora merge``."""

from __future__ import annotations

from pathlib import Path

import typer

from prime_core import hookimpl
from prime_core.specs import CliCommand, ConfigSection, ParallelStrategy

PRIME_PLUGIN_API = 1

lora_cli = typer.Typer(help="Work with LoRA adapters.", no_args_is_help=True)


@lora_cli.command("merge")
def merge_command(
    base: Path = typer.Argument(..., help="The base model folder."),
    adapter: Path = typer.Argument(..., help="An adapter folder (e.g. output_dir/weights/step_N)."),
    out: Path = typer.Argument(..., help="Where to write the merged model."),
) -> None:
    """Fold an adapter into its base model and save a full Hugging Face model."""
    from prime_plugin_lora.lora import merge

    typer.echo(f"wrote {merge(str(base), str(adapter), str(out))}")


@hookimpl
def prime_cli_commands():
    return [CliCommand(name="lora", app=lora_cli, description="Work with LoRA adapters.")]


@hookimpl
def prime_config_sections():
    return [
        ConfigSection(name="trainer.model", model="prime_plugin_lora.config:LoRAKeys", merge=True, roots=("rl", "sft")),
        ConfigSection(name="", model="prime_plugin_lora.config:ServeAdapters", merge=True, roots=("rl",)),
    ]


@hookimpl
def prime_parallel_strategies():
    return [ParallelStrategy(name="lora", slot="adapters", apply="prime_plugin_lora.lora:apply",
                             enabled=lambda config, world: config.lora is not None, reference=True,
                             memory="prime_plugin_lora.memory:memory",
                             description="LoRA adapters: only they are trained and published")]


@hookimpl
def prime_validate_config(config, root):
    from prime_core.config.shared import model_section

    model, key = model_section(config, root)
    lora = getattr(model, "lora", None)
    if lora is not None and lora.modules_to_save:
        return [f"{key}.lora.modules_to_save = {lora.modules_to_save}: not supported (vLLM cannot serve adapters "
                "with fully trained modules); leave it empty"]
    return None
