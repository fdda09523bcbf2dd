"""Where a run keeps its files under ``output_dir``, and the one way they are written.

    configs/        resolved configs, one per role (``prime <role> FILE`` runs each)
    logs/           one log per role (per rank for several trainer processes)
    rollouts/step_N step batches, written atomically by the orchestrator
    weights/step_N  published weights with a STABLE marker
    checkpoints/step_N  resumable checkpoints with a COMPLETE marker
    metrics.jsonl   one line per step and role
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def atomic_write_text(path: Path, text: str) -> None:
    """Write through a temporary file and rename, so readers never see half a file."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: Path, data: bytes | memoryview) -> None:
    """``atomic_write_text`` for bytes: a temporary name in the same folder, fsync, rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and folder under ``root`` (and ``root``): what is written before a
    completion marker must be on disk before the marker is."""
    root = Path(root)
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            fd = os.open(Path(folder) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(folder))


def replace_dir(tmp: Path, final: Path) -> None:
    """Put the finished folder ``tmp`` (fsynced) in place of ``final`` by renaming; an older
    ``final`` is moved aside first and removed only after, so that a crash at any moment leaves
    one whole folder."""
    import shutil

    tmp, final = Path(tmp), Path(final)
    old = final.with_name(f".{final.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def touch_marker(path: Path) -> None:
    """Write a completion marker durably (a marker that promises durable content comes after
    fsyncing it; published weights are fsynced after theirs: see ``prime_core.weights``)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(Path(path).parent)


@contextmanager
def writing(tmp: Path, what: str) -> Iterator[Path]:
    """Fill the temporary folder ``tmp`` with ``what`` (``"the final model"``); if that fails it
    is removed (a full disk gets its space back) and a failed write becomes a message naming
    the folder."""
    import shutil

    from prime_core.errors import PrimeError, storage_error

    try:
        yield tmp
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        friendly = storage_error(exc) if isinstance(exc, Exception) else None
        if friendly is None:
            raise
        raise PrimeError(f"{friendly.message} ({what}, in {tmp.parent})", hint=friendly.hint) from None
