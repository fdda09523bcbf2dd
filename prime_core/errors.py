"""Errors a user can cause. The CLI prints them without a traceback and exits with ``exit_code``."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class PrimeError(Exception):
    """An error with a message meant for the user, and the exit code the CLI should use."""

    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"


class ConfigError(PrimeError):
    """One or more problems with a config; every problem is reported at once."""

    exit_code = 2

    def __init__(self, problems: Iterable[str], *, source: str | None = None) -> None:
        self.problems = list(problems)
        self.source = source
        head = f"invalid config ({source})" if source else "invalid config"
        noun = "problem" if len(self.problems) == 1 else "problems"
        body = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{head}: {len(self.problems)} {noun}\n{body}")


class PluginError(PrimeError):
    """A plugin is missing, broken, disabled, conflicting or cannot run here."""

    exit_code = 2


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest candidate, or an empty string."""
    match = difflib.get_close_matches(word, sorted(set(candidates)), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""
