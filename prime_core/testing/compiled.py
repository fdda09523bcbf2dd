"""What a compiled model still runs in Python, for tests that a strategy keeps blocks compiled:
code that runs inside a compiled graph never calls its Python function."""

from __future__ import annotations

import sys
from collections.abc import Callable


def python_calls(function: Callable, run: Callable[[], object]) -> list[str]:
    """Run ``run()`` and return, for each call of ``function``'s own Python code during it, the
    name of the function that called it."""
    code = function.__code__
    callers: list[str] = []

    def record(frame, event, arg) -> None:
        if event == "call" and frame.f_code is code:
            callers.append(frame.f_back.f_code.co_name)

    sys.setprofile(record)
    try:
        run()
    finally:
        sys.setprofile(None)
    return callers
