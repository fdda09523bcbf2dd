"""Admission of sampling requests, for transformers versions whose manager cannot ``pause()``."""

from __future__ import annotations

import threading
from contextlib import contextmanager


class Gate:
    """Admission of sampling requests, for engines without ``pause()``: ``drained()`` stops
    new requests, waits for the running ones, and opens again on exit."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = True
        self._running = 0

    @contextmanager
    def admitted(self):
        with self._cond:
            self._cond.wait_for(lambda: self._open)
            self._running += 1
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    @contextmanager
    def drained(self):
        with self._cond:
            self._open = False
            self._cond.wait_for(lambda: self._running == 0)
        try:
            yield
        finally:
            with self._cond:
                self._open = True
                self._cond.notify_all()
