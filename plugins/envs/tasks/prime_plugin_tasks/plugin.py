"""Hooks of prime-plugin-tasks: procedurally generated RL environments (no downloads).

- ``reverse_text`` (args ``min_len``, ``max_len``, ``alphabet``): reverse a random string;
  reward is the similarity to the exact reversal.
- ``arithmetic`` (args ``digits``, ``operands``): add integers; reward 1 for the exact sum.
- ``calculator`` (args ``digits``, ``operations``): multi-digit arithmetic with a calculator
  tool (multi-turn); reward 1 for the exact value.
- ``guess`` (args ``low``, ``high``, ``max_turns``): guess a number from higher/lower replies
  (multi-turn); reward 1 for a right first guess, less per extra guess.
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
    demos: float = typer.Option(1.0, min=0.0, max=1.0,
                                help="For environments with a multi-turn demonstration (tool calls included): the "
                                     "share of tasks whose first turn is the demonstration's rather than the direct "
                                     "answer; the demonstration's later turns are written for every task."),
    tool_parser: str = typer.Option("hermes", help="Tool parser whose format the demonstrations' calls use."),
) -> None:
    """Write SFT chat data from any environment whose tasks have answers: prompt + reference
    answer, or, for environments with demonstrations, one example per assistant turn of one."""
    import random

    from prime_core.plugins import get_plugin_manager

    manager = get_plugin_manager()
    loaded = manager.select("environments", env, key="ENV").load(**json.loads(args))
    rng = random.Random(seed)
    tasks = loaded.tasks(rng, n)
    if any(t.answer is None for t in tasks):
        raise typer.BadParameter(f"environment '{env}' has no reference answers to learn from", param_hint="ENV")
    demonstrate = getattr(loaded, "demonstration", None)
    format_calls = manager.select("tool_parsers", tool_parser, key="--tool-parser").format if demonstrate else None
    out.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with out.open("w", encoding="utf-8") as f:
        for task in tasks:
            direct = [[*task.prompt, {"role": "assistant", "content": task.answer}]]
            if demonstrate is None:
                examples = direct
            else:
                conversation = demonstrate(task, format_calls)
                # One example per assistant turn: SFT trains the last assistant message of each.
                # The first turn is the demonstration's for a share `demos` of the tasks and the
                # direct answer otherwise; later turns (reading a tool's result) always come.
                turns = [conversation[:i + 1] for i, m in enumerate(conversation) if m["role"] == "assistant"]
                examples = (turns[:1] if rng.random() < demos else direct) + turns[1:]
            for messages in examples:
                f.write(json.dumps({"messages": messages}) + "\n")
                written += 1
    typer.echo(f"wrote {written} examples from {len(tasks)} tasks to {out}")


@hookimpl
def prime_environments():
    return [
        Environment(name="reverse_text", load="prime_plugin_tasks.reverse_text:ReverseText",
                    args="prime_plugin_tasks.args:ReverseTextArgs",
                    description="reverse a random string", aliases=("reverse-text",)),
        Environment(name="arithmetic", load="prime_plugin_tasks.arithmetic:Arithmetic",
                    args="prime_plugin_tasks.args:ArithmeticArgs",
                    description="add random integers"),
        Environment(name="calculator", load="prime_plugin_tasks.calculator:Calculator",
                    args="prime_plugin_tasks.args:CalculatorArgs",
                    description="multi-digit arithmetic with a calculator tool (multi-turn)"),
        Environment(name="guess", load="prime_plugin_tasks.guess:Guess", args="prime_plugin_tasks.args:GuessArgs",
                    description="guess a number from higher/lower replies (multi-turn)"),
    ]


@hookimpl
def prime_cli_commands():
    return [CliCommand(name="envs", app=cli, description="Make data from environments.")]
