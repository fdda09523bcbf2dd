"""Checking a completion's final answer against the reference with math-verify.

The answer is the content of the completion's last ``\\boxed{...}`` after any finished
``<think>...</think>`` (an unfinished one, or no box, scores 0), compared with the reference
(its own last ``\\boxed{}`` when it is a worked solution) as math: ``\\frac{1}{2}``, ``0.5``
and ``1/2`` are one answer.

math-verify bounds its work with ``signal.alarm``, which only works in a process's main thread,
while prime scores from worker threads; and an expression such as ``9^{9^{9^{9}}}`` can keep
the interpreter inside one C call that no signal interrupts. So the comparison runs in worker
processes, in their main thread with math-verify's own timeouts, and a worker that has not
answered well after them is killed and replaced: the answer scores 0 and the run goes on.
"""

from __future__ import annotations

import logging
import queue
import select
import subprocess
import sys
import threading
import weakref

logger = logging.getLogger(__name__)

BOXED = "\\boxed{"


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces matched), or ``None``."""
    start = text.rfind(BOXED)
    if start < 0:
        return None
    depth, begin = 1, start + len(BOXED)
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i]
    return None


def final_answer(completion: str) -> str | None:
    """What the completion answers, or ``None`` (thinking not finished, nothing boxed)."""
    if "<think>" in completion and "</think>" not in completion:
        return None
    answer = last_boxed(completion.rsplit("</think>", 1)[-1])
    return None if answer is None else answer.strip() or None


def reference_answer(answer: str) -> str:
    """The reference answer of a dataset row: the last box of a worked solution, or the text."""
    boxed = last_boxed(answer)
    return (boxed if boxed is not None and boxed.strip() else answer).strip()


def serve(timeout: int) -> None:
    """A checking process: reads ``[gold, prediction]`` JSON lines on stdin, answers ``1`` or
    ``0`` on stdout; stdin closing (the orchestrator is gone) ends it."""
    import json
    import signal

    from math_verify import parse, verify

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the orchestrator's to handle
    print("ready", flush=True)
    for line in sys.stdin:
        gold, prediction = json.loads(line)
        try:
            same = verify(parse(f"\\boxed{{{gold}}}", parsing_timeout=timeout),
                          parse(f"\\boxed{{{prediction}}}", parsing_timeout=timeout), timeout_seconds=timeout)
        except Exception:  # noqa: BLE001 - math-verify's own timeouts and parse failures: a wrong answer
            same = False
        print(1 if same else 0, flush=True)


class MathChecker:
    """Up to ``workers`` checking processes, started when first needed; ``check`` may be called
    from many threads at once."""

    START_TIMEOUT = 120.0  # importing sympy in a fresh process on a busy machine

    def __init__(self, timeout: int, workers: int) -> None:
        self.timeout, self.workers = timeout, workers
        self.limit = 3 * timeout + 5.0  # parse gold, parse prediction, verify: each bounded by `timeout`
        self._idle: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._running: set = set()
        self._closed = False
        # Stops the processes when the checker is collected or the interpreter exits without close().
        self._finalizer = weakref.finalize(self, _stop_all, self._running)

    def check(self, gold: str, prediction: str) -> bool:
        import json

        process = self._take()
        try:
            process.stdin.write(json.dumps([gold, prediction]) + "\n")
            process.stdin.flush()
            reply = _read_line(process, self.limit)
            if reply is not None:
                self._idle.put(process)
                return reply == "1"
            logger.warning("math-env: math-verify took over %.0f s on %.200r; the check was killed and scores 0",
                           self.limit, prediction)
        except (OSError, ValueError) as exc:
            logger.warning("math-env: a math-verify process failed (%s); the answer scores 0", exc)
        self._stop(process)
        return False

    def close(self) -> None:
        """Stop every checking process (idempotent)."""
        with self._lock:
            self._closed = True
        self._finalizer()

    def _take(self):
        while True:
            with self._lock:
                if self._closed:
                    raise RuntimeError("math-env: the answer checker was closed")
                start = self._idle.empty() and len(self._running) < self.workers
                if start:
                    placeholder = object()  # counts against `workers` while the process starts
                    self._running.add(placeholder)
            if start:
                break
            try:  # a bounded wait: a worker killed meanwhile frees a slot for a new one instead
                return self._idle.get(timeout=0.5)
            except queue.Empty:
                continue
        try:
            process = self._start()
        except BaseException:
            with self._lock:
                self._running.discard(placeholder)
            raise
        with self._lock:
            self._running.discard(placeholder)
            self._running.add(process)
        return process

    def _start(self) -> subprocess.Popen:
        # A fresh interpreter running this module: no copy of the orchestrator's threads (fork),
        # and no re-import of the caller's main script (multiprocessing's spawn).
        process = subprocess.Popen([sys.executable, "-m", __name__, str(self.timeout)], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True, bufsize=1)
        if _read_line(process, self.START_TIMEOUT) != "ready":
            self._stop(process)
            raise RuntimeError(f"math-env: a math-verify process ({sys.executable} -m {__name__}) did not start "
                               f"within {self.START_TIMEOUT:.0f} s")
        return process

    def _stop(self, process: subprocess.Popen) -> None:
        with self._lock:
            self._running.discard(process)
        _stop_process(process)


def _stop_process(process: subprocess.Popen) -> None:
    for stream in (process.stdin, process.stdout):
        try:
            stream.close()  # stdin closing ends a healthy worker
        except OSError:
            pass
    try:
        process.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _stop_all(running: set) -> None:
    for process in list(running):
        if isinstance(process, subprocess.Popen):
            running.discard(process)
            _stop_process(process)


def _read_line(process: subprocess.Popen, timeout: float) -> str | None:
    """The next line the process writes within ``timeout`` seconds, or ``None``."""
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    line = process.stdout.readline() if ready else ""
    return line.strip() if line.endswith("\n") else None


if __name__ == "__main__":
    serve(int(sys.argv[1]))
