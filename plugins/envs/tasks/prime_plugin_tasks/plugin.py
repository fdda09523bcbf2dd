"""Hooks of prime-plugin-tasks: procedurally generated RL environments (no downloads).

- ``reverse_text`` (args ``min_len``, ``max_len``, ``alphabet``): reverse a random string;
  reward is the similarity to the exact reversal.
- ``arithmetic`` (args ``digits``, ``operands``): add integers; reward 1 for the exact sum.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from prime_core import hookimpl
from prime_core.specs import CliCommand, Environment

PRIME_PLUGIN_API = 1

cli = typer.Typer(help="Environments: make data from them.", no_args_is_help=True)


@cli.command("sft-data")
def sft_data(
    env: str = typer.Argument(..., help="Environment name, e.g. reverse_text."),
    out: Path = typer.Argument(..., help="JSONL file to write."),
    n: int = typer.Option(1000, "--n", help="Number of examples."),
    seed: int = typer.Option(0, help="Sampling seed."),
    args: str = typer.Option("{}", help="Environment arguments as JSON."),
) -> None:
    """Write SFT chat data (prompt + reference answer) from any environment whose tasks have answers."""
    import random

    from prime_core.plugins import get_plugin_manager

    loaded = get_plugin_manager().select("environments", env, key="ENV").load(**json.loads(args))
    tasks = loaded.tasks(random.Random(seed), n)
    if any(t.answer is None for t in tasks):
        raise typer.BadParameter(f"environment '{env}' has no reference answers to learn from", param_hint="ENV")
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for task in tasks:
            f.write(json.dumps({"messages": [*task.prompt, {"role": "assistant", "content": task.answer}]}) + "\n")
    typer.echo(f"wrote {len(tasks)} examples to {out}")


def _reverse_text(**args):
    from prime_plugin_tasks.reverse_text import ReverseText

    return ReverseText(**args)


def _arithmetic(**args):
    from prime_plugin_tasks.arithmetic import Arithmetic

    return Arithmetic(**args)


@hookimpl
def prime_environments():
    return [
        Environment(name="reverse_text", load=_reverse_text, args="prime_plugin_tasks.args:ReverseTextArgs",
                    description="reverse a random string", aliases=("reverse-text",)),
        Environment(name="arithmetic", load=_arithmetic, args="prime_plugin_tasks.args:ArithmeticArgs",
                    description="add random integers"),
    ]


@hookimpl
def prime_cli_commands():
    return [CliCommand(name="envs", app=cli, description="Make data from environments.")]
