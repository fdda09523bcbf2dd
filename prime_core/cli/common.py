"""Helpers shared by the commands that take a config."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prime_core.plugins import PluginManager, get_plugin_manager

if TYPE_CHECKING:
    from pydantic import BaseModel


def load_config(root: str, tokens: list[str], manager: PluginManager | None = None) -> BaseModel:
    """Parse ``tokens`` (files, ``@ file``, ``--key value``) and return the validated config."""
    from prime_core.config.cli_args import parse_args
    from prime_core.config.load import load

    config, _ = load(root, parse_args(tokens), manager=manager or get_plugin_manager())
    return config
