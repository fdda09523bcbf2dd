"""Helpers shared by the commands that take a config."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prime_core.plugins import PluginManager, get_plugin_manager

if TYPE_CHECKING:
    from pydantic import BaseModel

    from prime_core.errors import PrimeError

CONFIG_ARGS = {"allow_extra_args": True, "ignore_unknown_options": True}
"""Click settings of the commands that take config files and ``--key value`` overrides."""
CONFIG_USAGE = "[CONFIG]... [--KEY VALUE]..."


def run_switches(bench: str) -> str:
    """The switches of a command that launches a run (``prime run``, ``prime sft``), for its help."""
    return (f"--dry-run writes the resolved configs and the launch plan and starts nothing; --bench {bench}; "
            "--clean deletes output_dir's previous run, --resume continues it; --output-dir DIR.\n\n")


def config_epilog(root: str, switches: str = "") -> str:
    """What a config-taking command's ``--help`` ends with: how its arguments read, and where
    every key is listed (the options are the config's keys, too many for the help itself)."""
    return (f"{switches}CONFIG: TOML or YAML files, later ones winning (`@ FILE` too, as prime-rl writes it). "
            "--KEY VALUE sets one key (--max-steps 20, --trainer.optim.lr 1e-5; dashes or underscores).\n\n"
            f"Every key, its default and what it does: `prime config keys --root {root} [PREFIX]`. The config "
            f"the arguments resolve to: `prime config show --root {root} CONFIG...`.")


def print_error(exc: PrimeError) -> None:
    from rich.console import Console

    console = Console(stderr=True, highlight=False, soft_wrap=True)
    console.print("error:", style="bold red", end=" ")
    console.print(str(exc), markup=False)


def print_warning(text: str) -> None:
    from rich.console import Console

    Console(stderr=True, highlight=False, soft_wrap=True).print(f"warning: {text}", style="yellow", markup=False)


def load_config(root: str, tokens: list[str], manager: PluginManager | None = None, *,
                environ=None) -> BaseModel:
    """Parse ``tokens`` (files, ``@ file``, ``--key value``) and return the validated config;
    ``PRIME_*`` variables come from ``environ`` (this process's environment by default).
    Hugging Face ids resolve as the roles will (``HF_HUB_OFFLINE=1`` unless set): a check of a
    model's config never waits on a network that the run would not use."""
    return load_config_and_sources(root, tokens, manager, environ=environ)[0]


def load_config_and_sources(root: str, tokens: list[str], manager: PluginManager | None = None, *,
                            environ=None) -> tuple[BaseModel, dict[tuple[str, ...], str]]:
    """``load_config``, and where each key was set: then ``checks.check``'s problems can name the
    file to change (``report.with_sources``)."""
    from prime_core.config.cli_args import parse_args
    from prime_core.config.load import load
    from prime_core.config.prime_rl import notes
    from prime_core.hub import default_offline

    default_offline()

    config, sources = load(root, parse_args(tokens), manager=manager or get_plugin_manager(), environ=environ)
    for line in notes(config):
        print_warning(line)
    return config, sources
