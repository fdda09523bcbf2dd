"""Run the processes of a plan on this machine and stop them all together.

Each role gets its own process group and log file. When any role exits with an error, or
the user presses Ctrl-C, every other role is stopped (SIGTERM to its whole group, SIGKILL
after a grace period) and the failing role is named with the end of its log. Service roles
(the inference server) are stopped once every non-service role has finished cleanly.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from prime_core.launch.plan import ROLE_PROCESS_ENV, LaunchPlan, RoleProcess

GRACE_SECONDS = 10.0


@dataclass
class Outcome:
    code: int
    failed_role: str | None = None
    message: str = ""


def tail(path: Path, lines: int = 20, width: int = 400) -> str:
    """The last ``lines`` lines of a log, each cut to ``width`` characters, for error messages."""
    try:
        with path.open("r", encoding="utf-8", errors="replace") as f:
            last = deque(f, maxlen=lines)
    except OSError:
        return "(no log)"
    return "".join(line if len(line) <= width else line[:width] + "...\n" for line in last).rstrip() or "(empty log)"


def _start(proc: RoleProcess) -> subprocess.Popen:
    proc.log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **proc.env, "PYTHONUNBUFFERED": "1", ROLE_PROCESS_ENV: "1"}
    if proc.console:  # the process writes its own log (per rank) and prints to this terminal
        return subprocess.Popen(proc.command, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    log = proc.log.open("ab")
    try:
        return subprocess.Popen(proc.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
    finally:
        log.close()


def _stop(running: dict[str, subprocess.Popen], grace: float = GRACE_SECONDS) -> None:
    for p in running.values():
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace
    for p in running.values():
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


class _Interrupts:
    """Ctrl-C (SIGINT) and SIGTERM as a flag the supervision loop polls, instead of an
    exception raised wherever the main thread happens to be: inside the progress display's
    lock, that exception left its refresh thread waiting for ever (seen on a loaded machine)."""

    def __init__(self):
        self.requested = 0  # the signal number once one arrived
        self._previous = {}

    def __enter__(self):
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.requested = signum

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def supervise(plan: LaunchPlan, *, poll_interval: float = 0.2, on_tick=None) -> Outcome:
    """Start every process of ``plan`` and wait; returns how the run ended."""
    with _Interrupts() as interrupts:
        return _supervise(plan, poll_interval, on_tick, interrupts)


def _supervise(plan: LaunchPlan, poll_interval: float, on_tick, interrupts: _Interrupts) -> Outcome:
    procs = {p.role: p for p in plan.processes}
    running: dict[str, subprocess.Popen] = {}
    try:
        for proc in plan.processes:
            running[proc.role] = _start(proc)
        while True:
            if interrupts.requested:
                _stop(running)
                return Outcome(code=128 + interrupts.requested, message="interrupted: stopped every role")
            for role, popen in running.items():
                code = popen.poll()
                # A service (the inference server) must outlive the workers: its exit is a failure.
                if code is not None and (code != 0 or procs[role].service):
                    _stop({r: p for r, p in running.items() if r != role})
                    log = procs[role].log
                    return Outcome(
                        code=code if code > 0 else 128 - code,
                        failed_role=role,
                        message=f"role '{role}' exited with code {code}; last lines of {log}:\n{tail(log)}",
                    )
            workers = [r for r, p in procs.items() if not p.service]
            if workers and all(running[r].poll() == 0 for r in workers):
                _stop(running)
                return Outcome(code=0)
            if not workers and all(p.poll() is not None for p in running.values()):
                return Outcome(code=0)
            if on_tick is not None:
                on_tick()
            time.sleep(poll_interval)
    except KeyboardInterrupt:
        _stop(running)
        return Outcome(code=130, message="interrupted: stopped every role")
    except BaseException:
        _stop(running)
        raise


def run_here(plan: LaunchPlan) -> int:
    """What a launcher that starts processes on this machine does with its plan: an inline
    role runs in this process; otherwise every process is started and supervised, with
    progress from ``metrics.jsonl`` unless a process prints to the terminal itself."""
    from rich.console import Console

    from prime_core.launch.progress import RunProgress
    from prime_core.metrics import METRICS_FILE

    if plan.inline:
        from prime_core.cli.roles import run_role

        (process,) = plan.processes
        os.environ.update(process.env)
        return run_role(process.role, [str(process.config)])
    console = Console(stderr=True, highlight=False)
    for process in plan.processes:
        where = "output on this terminal; " if process.console else ""
        console.print(f"starting {process.role} ({where}log: {process.log})", markup=False)
    if any(p.console for p in plan.processes):  # the role prints its own progress
        outcome = supervise(plan)
    else:
        with RunProgress(plan.output_dir / METRICS_FILE, plan.total_steps) as progress:
            outcome = supervise(plan, on_tick=progress.tick)
    if outcome.code:
        console.print("error:", style="bold red", end=" ")
        console.print(outcome.message, markup=False)
    else:
        console.print(f"run finished: outputs in {plan.output_dir}", markup=False)
    return outcome.code
