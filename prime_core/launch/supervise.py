"""Run the processes of a plan on this machine and stop them all together.

Each role gets its own process group and log file. When any role exits with an error, or
the user presses Ctrl-C, every other role is stopped (SIGTERM to its whole group, SIGKILL
after a grace period) and the failing role is named with the end of its log. Service roles
(the inference server) are stopped once every non-service role has finished cleanly. A role
that ``may_fail`` (an inference replica the orchestrator can do without) only gets a note.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from prime_core.launch.lifeline import LAUNCHER_ENV, identity, parent_death_signal
from prime_core.launch.plan import ROLE_PROCESS_ENV, LaunchPlan, RoleProcess

GRACE_SECONDS = 10.0


@dataclass
class Outcome:
    code: int
    failed_role: str | None = None
    message: str = ""


NOISE = re.compile(r'HTTP Request: [A-Z]+ |"[A-Z]+ \S+ HTTP/\d(\.\d)?" \d{3}')
"""Request lines (httpx's client log, uvicorn's access log): what a failing role's log ends
with, and never why it failed."""
EXCEPTION = re.compile(r"\b[A-Z]\w*(Error|Exception)\b: |^error: ")
CALM = re.compile(r"\b(WARNING|WARN|INFO|DEBUG)\b")


def _lines(path: Path, since: int = 0):
    with path.open("rb") as f:
        f.seek(since)
        for raw in f:
            yield raw.decode("utf-8", errors="replace")


def tail(path: Path, lines: int = 20, width: int = 400, *, since: int = 0) -> str:
    """The last ``lines`` lines of a log from byte ``since`` on, request lines left out, each
    cut to ``width`` characters, for error messages."""
    try:
        last = deque((line for line in _lines(path, since) if not NOISE.search(line)), maxlen=lines)
    except OSError:
        return "(no log)"
    return "".join(line if len(line) <= width else line[:width] + "...\n" for line in last).rstrip() or "(empty log)"


def first_errors(path: Path, *, since: int = 0, limit: int = 3, width: int = 400) -> list[str]:
    """The first distinct exception messages of a log (``SomeError: why``): the cause, which the
    end of a long traceback hides."""
    found: list[str] = []
    try:
        for line in _lines(path, since):
            text = line.strip()[:width]
            if EXCEPTION.search(text) and not CALM.search(text) and not NOISE.search(text) and text not in found:
                found.append(text)
                if len(found) == limit:
                    break
    except OSError:
        pass
    return found


def failure_report(path: Path, lines: int = 20, *, since: int = 0) -> str:
    """What a failure message shows of a log: its first error lines, then its last lines."""
    errors = first_errors(path, since=since)
    head = "first errors in the log:\n" + "\n".join(f"  {e}" for e in errors) + "\n" if errors else ""
    return f"{head}--- last lines of {path} ---\n{tail(path, lines, since=since)}"


def shared_cores_env(processes: list[RoleProcess]) -> dict[str, str]:
    """The environment roles that share this machine's cores need: OpenMP threads that sleep
    when idle (``OMP_WAIT_POLICY=PASSIVE``) instead of spinning for a few milliseconds at every
    barrier, which takes the cores from the other roles' threads. Nothing for a lone process,
    nor where the user set a policy. On 2 CPU cores the CPU RL example's step went from 2.4 s
    to 1.4 s with it (trainer, orchestrator and vLLM each with their threads)."""
    if len(processes) < 2 or "OMP_WAIT_POLICY" in os.environ:
        return {}
    return {"OMP_WAIT_POLICY": "PASSIVE"}


def _start(proc: RoleProcess, shared: dict[str, str] | None = None) -> subprocess.Popen:
    proc.log.parent.mkdir(parents=True, exist_ok=True)
    # Tied to this process (lifeline): the role dies with it, whatever kills it.
    env = {**os.environ, **(shared or {}), **proc.env, "PYTHONUNBUFFERED": "1", ROLE_PROCESS_ENV: "1",
           LAUNCHER_ENV: identity()}
    tie = parent_death_signal()
    if proc.console:  # the process writes its own log (per rank) and prints to this terminal
        return subprocess.Popen(proc.command, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                preexec_fn=tie)
    log = proc.log.open("ab")
    try:
        return subprocess.Popen(proc.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True, preexec_fn=tie)
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


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Ctrl-C, ``kill``, and the hang-up of a closed terminal or SSH session: each stops every role."""


class _Interrupts:
    """Ctrl-C (SIGINT), SIGTERM and SIGHUP as a flag the supervision loop polls, instead of an
    exception raised wherever the main thread happens to be: inside the progress display's
    lock, that exception left its refresh thread waiting for ever (seen on a loaded machine)."""

    def __init__(self):
        self.requested = 0  # the signal number once one arrived
        self._previous = {}

    def __enter__(self):
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.requested = signum

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def supervise(plan: LaunchPlan, *, poll_interval: float = 0.2, on_tick=None, on_note=None) -> Outcome:
    """Start every process of ``plan`` and wait; returns how the run ended. ``on_note(text)``
    hears of roles that ended and were allowed to (``RoleProcess.may_fail``)."""
    with _Interrupts() as interrupts:
        return _supervise(plan, poll_interval, on_tick, on_note or print, interrupts)


def _supervise(plan: LaunchPlan, poll_interval: float, on_tick, on_note, interrupts: _Interrupts) -> Outcome:
    procs = {p.role: p for p in plan.processes}
    running: dict[str, subprocess.Popen] = {}
    answered: set[str] = set()  # services that have answered on their port (``answering``)
    shared = shared_cores_env(plan.processes)
    try:
        for proc in plan.processes:
            running[proc.role] = _start(proc, shared)
        while True:
            if interrupts.requested:
                _stop(running)
                return Outcome(code=128 + interrupts.requested, message="interrupted: stopped every role")
            for role in [r for r, p in running.items() if procs[r].may_fail and p.poll() is not None]:
                ended = running.pop(role)
                on_note(f"warning: role '{role}' exited with code {ended.returncode}; the run goes on without it "
                        f"(log: {procs[role].log})")
            answered.update(r for r, p in running.items() if procs[r].service and procs[r].port is not None
                            and r not in answered and p.poll() is None and answering(procs[r].port, timeout=0.1))
            failed = _failed(procs, running)
            if failed:
                return _failure(procs, running, failed, answered)
            workers = [r for r, p in procs.items() if not p.service and r in running]
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


SETTLE_SECONDS = 10.0
"""After a role fails while a service (the inference server) still runs, how long the others
may take to fail too before being stopped: a dead inference server makes the orchestrator fail
within a second or two, and the server is the role to report; the inference role itself needs a
few seconds more to see its server's death and stop what is left of it (measured up to 4 s on 2
busy cores). There is nothing such a wait could find with no service running, nor when each
running service on a known port either answers on it (``answering``) or never has (it was still
starting: its clients were waiting for it, not failing on it). The failure is then the role's own."""


def answering(port: int | None, timeout: float = 0.5) -> bool:
    """Whether a server on this machine's ``port`` answers ``GET /health`` with a status below
    500 (an API key's 401 included: the server is up). ``False`` where that cannot be told.

    The connection ends with a reset from this side, so neither end keeps the port in
    TIME_WAIT: an orderly close by the server would leave its port unbindable for a minute
    after the run (without ``SO_REUSEADDR``), as if the server had outlived it."""
    import socket
    import struct

    if port is None:
        return False
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.sendall(f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
            status = sock.recv(64).split(b" ", 2)
    except OSError:
        return False
    return len(status) > 1 and status[0].startswith(b"HTTP/") and status[1].isdigit() and int(status[1]) < 500


def _failed(procs: dict[str, RoleProcess], running: dict[str, subprocess.Popen]) -> list[str]:
    """Roles that failed: a non-zero exit, or a service (the inference server), which must
    outlive the workers, exiting at all."""
    return [role for role, popen in running.items()
            if popen.poll() is not None and (popen.returncode != 0 or procs[role].service)]


def _failure(procs: dict[str, RoleProcess], running: dict[str, subprocess.Popen], failed: list[str],
             answered: set[str]) -> Outcome:
    deadline = time.monotonic() + SETTLE_SECONDS

    def settling() -> bool:
        """Whether a running service may be dying: its port unknown, or silent after answering."""
        return any(procs[r].port is None or (r in answered and not answering(procs[r].port))
                   for r, p in running.items() if procs[r].service and p.poll() is None)

    while time.monotonic() < deadline and not any(procs[r].service for r in failed) and settling():
        time.sleep(0.1)
        failed = list(dict.fromkeys([*failed, *_failed(procs, running)]))
    _stop({r: p for r, p in running.items() if r not in failed})
    # A service that died explains the others' failures (the orchestrator's refused connections).
    role = next((r for r in failed if procs[r].service), failed[0])
    code = running[role].returncode
    also = [f"{r} (code {running[r].returncode})" for r in failed if r != role]
    message = f"role '{role}' exited with code {code}" + (f"; then {', '.join(also)}" if also else "")
    return Outcome(code=code if code > 0 else (128 - code if code < 0 else 1), failed_role=role,
                   message=f"{message}\n{failure_report(procs[role].log)}")


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
    console = Console(stderr=True, highlight=False, soft_wrap=True)  # paths in messages stay whole
    for process in plan.processes:
        where = "output on this terminal; " if process.console else ""
        console.print(f"starting {process.role} ({where}log: {process.log})", markup=False)
    def note(text: str) -> None:
        console.print(text, markup=False, style="yellow")

    if any(p.console for p in plan.processes):  # the role prints its own progress
        outcome = supervise(plan, on_note=note)
    else:
        with RunProgress(plan.output_dir / METRICS_FILE, plan.total_steps) as progress:
            outcome = supervise(plan, on_tick=progress.tick, on_note=progress.note)
    if outcome.code:
        console.print("error:", style="bold red", end=" ")
        console.print(outcome.message, markup=False)
    else:
        console.print(f"run finished: outputs in {plan.output_dir}", markup=False)
    return outcome.code
