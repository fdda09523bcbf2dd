"""Roles die with the launcher that started them, whatever ends the launcher (SIGKILL,
SIGHUP from a closed terminal, a crash).

Two ties, because neither reaches every process alone:

- ``parent_death_signal()``: a ``preexec_fn`` asking the kernel to SIGTERM the child when
  the thread that started it ends (``PR_SET_PDEATHSIG``). It reaches direct children only:
  torchrun, but not the ranks it starts; the inference role, but not vLLM's engine.
- ``watch_launcher()``: every process of a role (torchrun ranks included: they inherit the
  environment) that finds ``PRIME_LAUNCHER`` set polls that launcher and, once it is gone,
  SIGTERMs itself (the inference role then stops its server's whole process group), and
  SIGKILLs itself if that has not ended it after ``GRACE_SECONDS``.

The launcher is named by pid *and* start time, so a recycled pid is not mistaken for it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

LAUNCHER_ENV = "PRIME_LAUNCHER"
"""``PID:START_TIME`` of the launcher whose roles must not outlive it."""
POLL_SECONDS = 0.5
GRACE_SECONDS = 12.0
"""After the SIGTERM, how long a role may take to stop (the inference role stops vLLM within 10 s)."""


def _stat(pid: int | str) -> list[str]:
    """``/proc/PID/stat``'s fields after the name, from the state on (``[]`` when the process
    is gone): ``[state, ppid, pgrp, ...]``."""
    try:
        stat = open(f"/proc/{pid}/stat", encoding="ascii", errors="replace").read()  # noqa: SIM115
    except OSError:
        return []
    return stat[stat.rfind(")") + 2:].split()  # the name may hold spaces and parentheses


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22), or
    ``None`` when it is gone or a zombie."""
    fields = _stat(pid)
    if not fields or fields[0] in ("Z", "X"):
        return None
    return fields[19]


def processes() -> dict[int, tuple[int, int]]:
    """Every running process now (zombies left out): ``pid -> (parent pid, process group)``,
    from ``/proc``; empty where there is none."""
    table = {}
    for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if name.isdigit() and len(fields := _stat(name)) > 2 and fields[0] not in ("Z", "X"):
            table[int(name)] = (int(fields[1]), int(fields[2]))
    return table


def descendants(pid: int) -> set[int]:
    """Every running process below ``pid`` now: children, grandchildren, ..."""
    parents = {child: parent for child, (parent, _) in processes().items()}
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def identity(pid: int | None = None) -> str:
    """``PID:START_TIME`` of ``pid`` (this process by default), the value of ``PRIME_LAUNCHER``."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{start_time(pid) or '?'}"


def alive(ident: str) -> bool:
    """Whether the process named by ``identity()`` still runs (a zombie does not)."""
    pid, _, started = ident.partition(":")
    try:
        now = start_time(int(pid))
    except ValueError:
        return False
    if now is None:
        return False
    return started in ("?", "") or now == started


def parent_death_signal(sig: int = signal.SIGTERM):
    """A ``preexec_fn`` that has the kernel send ``sig`` to the child when the calling thread
    ends, or ``None`` where that is not available (not Linux; a thread other than the main
    one, whose end would fire it early)."""
    if sys.platform != "linux" or threading.current_thread() is not threading.main_thread():
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not in the forked child
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def tie() -> None:
        prctl(1, int(sig))  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the tie was made
            os.kill(os.getpid(), signal.SIGKILL)

    return tie


_watching = False


def watch_launcher(environ=None) -> bool:
    """Start the watchdog thread when ``PRIME_LAUNCHER`` names a launcher; ``True`` if one runs.
    Idempotent."""
    global _watching
    environ = os.environ if environ is None else environ
    ident = environ.get(LAUNCHER_ENV)
    if not ident or _watching or sys.platform != "linux":
        return _watching
    _watching = True
    threading.Thread(target=_watch, args=(ident,), name="prime-launcher-watchdog", daemon=True).start()
    return True


def _watch(ident: str) -> None:
    while alive(ident):
        time.sleep(POLL_SECONDS)
    print(f"the launcher (pid {ident.split(':')[0]}) is gone: stopping this role", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_SECONDS)
    os.kill(os.getpid(), signal.SIGKILL)
