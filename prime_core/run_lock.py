"""One run per ``output_dir`` at a time: a lock held for the life of the run.

- A launch (``prime run``, ``prime sft``, ``prime inference`` typed by a user, ``--dry-run``
  included: it writes ``configs/``) holds ``output_dir/.prime.lock`` exclusively, before
  anything in the folder is deleted or written.
- A role run by hand (``prime trainer FILE`` in a tmux pane, a SLURM job's roles) holds that
  file shared, so that the roles of one run coexist and no launch can start beside them, and
  the trainer, orchestrator and SFT also hold ``.prime.<role>.lock`` exclusively (one of each
  per folder). Only rank 0 of several processes locks.
- A role started by a launcher (``PRIME_LAUNCHER`` set) locks nothing: its launcher holds the
  folder for it (node 0's, for the other nodes of a multi-node launch).

Locks are ``flock`` locks: the kernel releases them when their holder dies, so the lock of a
crashed or killed run is simply taken over (and said so). Each holder writes who it is
(pid, host, command, start time) into its file, which is what a refused run is told.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from prime_core.errors import PrimeError

RUN_LOCK = ".prime.lock"
_HELD_HERE: set[Path] = set()
"""Folders this process holds as a launch (an inline role, ``prime sft`` on one device, locks nothing more)."""
RELEASED = "released"
UNSUPPORTED = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)
"""flock errors of filesystems without locks (some network filesystems): run unlocked, warned."""


def _describe(info: dict) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("started", 0)))
    return f"pid {info.get('pid')} on {info.get('host')} since {when}: {info.get('command')}"


def check_output_dir(output_dir: Path, key: str = "output_dir") -> None:
    """Refuse an ``output_dir`` that is a file or cannot be written, with the fix; creates nothing."""
    path = Path(output_dir).expanduser()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        what = "is a file" if existing == path else f"cannot be created: {existing} is a file"
        raise PrimeError(f"{key} = {output_dir} {what}, not a folder",
                         hint=f"choose another --{key.replace('_', '-')}, or move that file away")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PrimeError(f"{key} = {output_dir} is not writable ({existing} does not allow this user to write)",
                         hint=f"choose a writable --{key.replace('_', '-')}, or fix the folder's permissions")


def _held(path: Path) -> bool:
    """Whether some process holds a lock on ``path`` (tried without waiting, and let go)."""
    try:
        with open(path, encoding="utf-8") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                return exc.errno not in UNSUPPORTED
            fcntl.flock(handle, fcntl.LOCK_UN)
            return False
    except OSError:
        return False


class OutputDirLock:
    """Holds the locks of one process on ``output_dir`` (see the module docstring)."""

    def __init__(self, output_dir: Path, *, role: str | None = None, name: str | None = None) -> None:
        self.output_dir = Path(output_dir)
        self.role = role
        """``None`` for a launch (the run lock, exclusive); a role name for a role by hand."""
        self.name = name or role
        """The role's own lock, ``.prime.<name>.lock`` (``inference.HOST.PORT`` for a server)."""
        self.files: list = []
        self.created: list[Path] = []
        self.took_over: str | None = None
        """Who held the lock before and ended without releasing it (a crash, a kill)."""

    def acquire(self) -> OutputDirLock:
        check_output_dir(self.output_dir)
        self._mkdirs()
        try:
            exclusive = self.role is None
            self._lock(self.output_dir / RUN_LOCK, exclusive=exclusive, write_info=exclusive)
            if self.name:
                self._lock(self.output_dir / f".prime.{self.name}.lock", exclusive=True, write_info=True)
        except BaseException:
            self.release(remove_created=True)
            raise
        if self.role is None:
            _HELD_HERE.add(self.output_dir.resolve())
        return self

    def _mkdirs(self) -> None:
        missing = []
        path = self.output_dir
        while not path.exists():
            missing.append(path)
            path = path.parent
        try:
            self.output_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise PrimeError(f"output_dir = {self.output_dir} cannot be created: {exc.strerror or exc}",
                             hint="choose a writable --output-dir") from None
        self.created.extend(missing)

    def _lock(self, path: Path, *, exclusive: bool, write_info: bool) -> None:
        new = not path.exists()
        try:
            handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held for the life of the run
        except OSError as exc:
            raise PrimeError(f"output_dir = {self.output_dir}: cannot create the lock file {path}: "
                             f"{exc.strerror or exc}", hint="choose a writable --output-dir") from None
        if new:
            self.created.insert(0, path)
        try:
            fcntl.flock(handle, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except OSError as exc:
            handle.close()
            if exc.errno in UNSUPPORTED:
                print(f"warning: {path.parent}'s filesystem does not support file locks ({exc.strerror}): "
                      "nothing stops a second run from using this output_dir", file=sys.stderr, flush=True)
                return
            raise self._busy(path) from None
        self.files.append(handle)
        if write_info:
            handle.seek(0)
            previous = handle.read().strip()
            if previous and previous != RELEASED:
                try:
                    self.took_over = _describe(json.loads(previous))
                except ValueError:
                    pass
            info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                    "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:300], "role": self.role}
            handle.seek(0)
            handle.truncate()
            handle.write(json.dumps(info) + "\n")
            handle.flush()

    def _busy(self, path: Path) -> PrimeError:
        holders = []
        candidates = [path] if path.name != RUN_LOCK else [path, *sorted(self.output_dir.glob(".prime.*.lock"))]
        for candidate in candidates:
            if not _held(candidate):
                continue
            try:
                text = candidate.read_text(encoding="utf-8").strip()
                if text and text != RELEASED:
                    holders.append(_describe(json.loads(text)))
            except (OSError, ValueError):
                continue
        who = "; ".join(dict.fromkeys(holders)) or "a process that did not say who it is"
        what = "a run" if path.name == RUN_LOCK else f"another {self.role}"
        return PrimeError(
            f"output_dir = {self.output_dir} is in use by {what} ({who}); nothing was changed",
            hint="wait for it to end or stop it, or choose another --output-dir",
        )

    def release(self, *, remove_created: bool = False) -> None:
        """Unlock; ``remove_created`` also removes what ``acquire`` created (a refused run
        leaves the disk as it found it)."""
        for handle in self.files:
            try:
                if not remove_created:
                    handle.seek(0)
                    handle.truncate()
                    handle.write(RELEASED + "\n")
                    handle.flush()
                fcntl.flock(handle, fcntl.LOCK_UN)
            except OSError:
                pass
            handle.close()
        self.files = []
        if self.role is None:
            _HELD_HERE.discard(self.output_dir.resolve())
        if remove_created:
            for path in self.created:
                try:
                    path.rmdir() if path.is_dir() else path.unlink()
                except OSError:
                    pass
            self.created = []

    def __enter__(self) -> OutputDirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def lock_role(config, role: str) -> OutputDirLock | None:
    """The lock of a role process on its ``output_dir``, or ``None`` when it locks nothing: started
    by a launcher (which holds the folder), or not rank 0 of several processes."""
    from prime_core.launch.lifeline import LAUNCHER_ENV

    output_dir = getattr(config, "output_dir", None)
    if output_dir is None or os.environ.get(LAUNCHER_ENV) or os.environ.get("RANK", "0") != "0":
        return None
    if Path(output_dir).resolve() in _HELD_HERE:  # run inline by the launch that holds the folder
        return None
    name = role
    if role == "inference":  # servers of one run may share a folder across nodes: one lock each
        name = f"inference.{socket.gethostname()}.{config.server.port}"
    lock = OutputDirLock(output_dir, role=role, name=name).acquire()
    if lock.took_over:
        print(f"note: took over the lock of {output_dir} from an earlier process that ended without "
              f"releasing it ({lock.took_over})", flush=True)
    return lock
