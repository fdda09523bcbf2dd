"""Hooks of prime-plugin-report: the ``prime report`` command. Nothing heavy is imported here
(matplotlib only when a PNG is drawn)."""

from __future__ import annotations

from pathlib import Path

import typer

from prime_core import hookimpl
from prime_core.specs import CliCommand

PRIME_PLUGIN_API = 1


def report(
    output_dirs: list[Path] = typer.Argument(
        ..., metavar="OUTPUT_DIR...", help="A run's output_dir (its metrics.jsonl); more than one are overlaid."),
    out: Path | None = typer.Option(None, "--out", "-o", help="The PNG to write (default: FIRST_DIR/report.png)."),
    label: list[str] = typer.Option([], "--label", help="A name per run for the legend (default: the folder's name)."),
    no_plot: bool = typer.Option(False, "--no-plot", help="Print the summary only."),
) -> None:
    """Plot reward, eval pass@k, loss, entropy, mismatch KL, grad norm, throughput and off-policy
    lag over the steps of one or more runs, and print a summary of each."""
    from prime_plugin_report.report import load_runs, plot, summary

    runs = load_runs(output_dirs, label)
    typer.echo(summary(runs))
    if not no_plot:
        path = plot(runs, out or Path(output_dirs[0]) / "report.png")
        typer.echo(f"wrote {path}")


@hookimpl
def prime_cli_commands():
    return [CliCommand(name="report", app=report, description="Plot and summarise runs from their metrics.jsonl.")]
