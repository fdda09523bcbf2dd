"""What the server did on one version of the weights, for the line the engine logs when they change."""

from __future__ import annotations

import time


class Usage:
    """What was served on one version of the weights: samples, tokens and the busy time (some
    request running), for the log line written when the weights change."""

    def __init__(self) -> None:
        self.samples = self.tokens = self.running = 0
        self.busy = 0.0
        self._since: float | None = None

    def begin(self) -> None:
        if self.running == 0:
            self._since = time.perf_counter()
        self.running += 1

    def end(self, outputs: list) -> None:
        self.running -= 1
        self.samples += len(outputs)
        self.tokens += sum(len(o.generated_tokens) for o in outputs)
        if self.running == 0 and self._since is not None:
            self.busy += time.perf_counter() - self._since
            self._since = None

    def take(self) -> dict[str, float]:
        """The numbers so far (a busy period still running is cut at now), and start counting again."""
        now = time.perf_counter()
        taken = {"samples": self.samples, "tokens": self.tokens,
                 "busy": self.busy + (now - self._since if self._since is not None else 0.0)}
        self.samples = self.tokens = 0
        self.busy, self._since = 0.0, now if self.running else None
        return taken
