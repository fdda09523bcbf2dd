"""Errors a user can cause. The CLI prints them without a traceback and exits with ``exit_code``."""

from __future__ import annotations

import difflib
import errno
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


class UsageError(PrimeError):
    """A command given an option it does not take."""

    exit_code = 2


class PluginError(PrimeError):
    """A plugin is missing, broken, disabled, conflicting or cannot run here."""

    exit_code = 2


STORAGE_ERRNOS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "the operation is not permitted (a read-only or immutable folder?)",
}
_STORAGE_TEXT = {"No space left on device": errno.ENOSPC, "Disk quota exceeded": errno.EDQUOT,
                 "Read-only file system": errno.EROFS}


def storage_error(exc: BaseException) -> PrimeError | None:
    """A ``PrimeError`` for a failed write or read of a file (a full disk, a read-only or
    forbidden folder), from ``exc`` or any exception it was raised from; ``None`` for any other
    error. Libraries that write files (safetensors, torch checkpoints) wrap the ``OSError`` or
    only keep its text: both are recognised."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        code, where = None, None
        if isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS:
            code, where = exc.errno, exc.filename
        else:
            code = next((c for text, c in _STORAGE_TEXT.items() if text in str(exc)), None)
        if code is not None:
            what = STORAGE_ERRNOS[code]
            target = f"writing {where}" if where else f"writing a file ({type(exc).__name__}: {str(exc)[:200]})"
            hint = ("free some space (or point output_dir at a larger disk), then continue with --resume"
                    if code in (errno.ENOSPC, errno.EDQUOT) else
                    "choose a writable output_dir, or fix the permissions, then continue with --resume")
            return PrimeError(f"{what} while {target}", hint=hint)
        exc = exc.__cause__ or exc.__context__
    return None


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest candidate, or an empty string."""
    match = difflib.get_close_matches(word, sorted(set(candidates)), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""
