"""Hooks of prime-plugin-hf: the ``hf`` model implementation (any transformers causal LM)
and ``prime model tiny``, which builds a small model and tokenizer locally."""

from __future__ import annotations

from pathlib import Path

import typer

from prime_core import hookimpl
from prime_core.specs import CliCommand, ModelImpl

PRIME_PLUGIN_API = 1

model_cli = typer.Typer(help="Build and inspect models.", no_args_is_help=True)


@model_cli.command("tiny")
def tiny(
    out: Path = typer.Argument(..., help="Folder to write the model and tokenizer to."),
    hidden_size: int = typer.Option(128, help="Hidden size."),
    num_layers: int = typer.Option(2, help="Transformer blocks."),
    num_heads: int = typer.Option(4, help="Attention heads."),
    num_kv_heads: int = typer.Option(2, help="Key/value heads."),
    head_dim: int = typer.Option(32, help="Head size (vLLM on CPU needs 32, 64, 80, ...)."),
    dtype: str = typer.Option("float32", help="float32 or bfloat16."),
    seed: int = typer.Option(0, help="Initialisation seed."),
    num_experts: int = typer.Option(0, help="Experts per MoE layer (0: a dense Qwen3; else a Qwen3-MoE)."),
    experts_per_token: int = typer.Option(2, help="Experts each token is routed to (MoE)."),
) -> None:
    """Build a small random Qwen3 (or Qwen3-MoE) model and a byte-level tokenizer with a chat
    template (no downloads)."""
    from prime_plugin_hf.tiny import build_tiny

    path = build_tiny(out, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                      num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, seed=seed,
                      num_experts=num_experts, experts_per_token=experts_per_token)
    typer.echo(f"wrote {path}")


@hookimpl
def prime_model_impls():
    return [ModelImpl(name="hf", build="prime_plugin_hf.model:build", supports=lambda hf_config: True, priority=0,
                      memory="prime_plugin_hf.model:memory", description="any transformers causal LM")]


@hookimpl
def prime_cli_commands():
    return [CliCommand(name="model", app=model_cli, description="Build and inspect models.")]
