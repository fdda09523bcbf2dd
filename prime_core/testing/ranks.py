"""The ranks of a multi-process test run (gloo, one machine, no GPU), forked from a server
process that has imported torch and transformers once.

Under torchrun every rank is a fresh interpreter, and on a 2-core machine importing torch and
transformers is most of a tiny parity run: about 7 of a rank's 9 CPU seconds, plus torchrun's
own 2. ``launch`` starts the ranks from multiprocessing's fork server instead, preloaded
with those imports (one server per test process, started on first use): each rank begins with
them done and sets the environment torchrun would give it (``RANK``, ``WORLD_SIZE``, ...,
``OMP_NUM_THREADS=1`` unless set) before it runs the target. The ranks meet at a store this
process hosts on loopback, as torchrun's ``prime-loopback`` rendezvous does.

What torchrun itself does is tested where launching is the subject (the torchrun launcher's
tests, ``tests/test_loopback_rdzv.py``); here it is only the way to get N processes. Modules
imported by the server saw its environment, not the rank's: a test whose ranks must import
something under another environment (e.g. without ``TRITON_INTERPRET``) runs them under
torchrun (``launch(..., fresh=True)``). Only where no GPU is visible: a forked process must
not inherit an initialised CUDA; elsewhere ``launch`` runs torchrun. As with multiprocessing's
spawn, each rank imports the caller's main script again (as ``__mp_main__``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

PRELOAD = ["torch", "torch.distributed", "transformers.modeling_utils", "transformers.models.auto.modeling_auto",
           "transformers.models.qwen3.modeling_qwen3", "transformers.models.qwen3_moe.modeling_qwen3_moe"]
"""What the fork server imports for every rank (a missing one is skipped by multiprocessing)."""
GRACE = 5.0
"""Seconds between SIGTERM and SIGKILL for the ranks left when one failed or time ran out."""


def available() -> bool:
    """Whether ranks can be forked here: Linux (the fork server) and no GPU visible."""
    import torch

    return sys.platform == "linux" and not torch.cuda.is_available()


def launch(processes: int, target: str, argv: list[str], *, timeout: float, env: dict[str, str] | None = None,
           cwd: Path | None = None, log_dir: Path | None = None, fresh: bool = False) -> subprocess.CompletedProcess:
    """Run ``target`` in ``processes`` ranks: forked (``run_ranks``) where ``available`` and not
    ``fresh``, else under torchrun. ``target`` is a script's path, or ``"package.module:main"``
    (``main(argv)`` returns the exit code; torchrun runs ``python -m package.module``). Returns
    as ``subprocess.run`` does (forked ranks: every rank's log in ``stdout``); raises
    ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
    import tempfile

    from prime_core.launch.plan import python_command

    env = dict(os.environ if env is None else env)
    if processes > 1 and not fresh and available():
        if log_dir is not None:
            return run_ranks(processes, target, argv, env=env, timeout=timeout, log_dir=log_dir, cwd=cwd)
        with tempfile.TemporaryDirectory(prefix="prime-ranks-") as logs:
            return run_ranks(processes, target, argv, env=env, timeout=timeout, log_dir=Path(logs), cwd=cwd)
    entry = [target] if target.endswith(".py") else ["-m", target.partition(":")[0]]
    return subprocess.run([*python_command(processes), *entry, *argv], capture_output=True, text=True,
                          timeout=timeout, check=False, env=env, cwd=cwd)


def run_ranks(processes: int, target: str, argv: list[str], *, env: dict[str, str], timeout: float,
              log_dir: Path, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``target`` (as ``launch`` takes it) in ``processes`` ranks forked from the fork server.

    ``returncode`` is 0 when every rank exited 0, else what ``_wait`` saw fail first (``-N`` for
    a signal); ``stdout`` holds each rank's log (written to ``log_dir``) after a ``[rank N]``
    line. The other ranks are stopped when one fails; ``subprocess.TimeoutExpired`` after
    ``timeout`` seconds, every rank stopped."""
    import multiprocessing

    from prime_core.launch.loopback_rdzv import loopback_store

    store, port = loopback_store(timeout)
    log_dir.mkdir(parents=True, exist_ok=True)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    base = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0", "WORLD_SIZE": str(processes),
            "LOCAL_WORLD_SIZE": str(processes), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1"}
    base.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it for more than one process
    ranks, logs = [], [log_dir / f"rank{rank}.log" for rank in range(processes)]
    try:
        for rank in range(processes):
            rank_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)}
            process = context.Process(target=_rank, name=f"rank{rank}",
                                      args=(target, argv, rank_env, str(logs[rank]), str(cwd or os.getcwd()),
                                            os.getpid()))
            process.start()
            ranks.append(process)
        returncode = _wait(ranks, time.monotonic() + timeout)
    finally:
        _stop([r for r in ranks if r.exitcode is None])
        del store  # and its socket
    output = "".join(f"[rank {rank}]\n{log.read_text(errors='replace') if log.exists() else '(no log)'}\n"
                     for rank, log in enumerate(logs))
    if returncode is None:
        raise subprocess.TimeoutExpired(["run_ranks", target, *argv], timeout, output=output)
    return subprocess.CompletedProcess(["run_ranks", target, *argv], returncode, stdout=output, stderr="")


def _wait(ranks, deadline: float) -> int | None:
    """0 once every rank exited 0; else the exit code of the first failure seen (of several seen
    at once, the lowest: a signal's ``-N`` first); None at ``deadline``."""
    while time.monotonic() < deadline:
        codes = [r.exitcode for r in ranks]
        failed = sorted(code for code in codes if code not in (None, 0))
        if failed:
            return failed[0]
        if all(code == 0 for code in codes):
            return 0
        time.sleep(0.05)
    return None


def _stop(ranks) -> None:
    for rank in ranks:
        rank.terminate()
    deadline = time.monotonic() + GRACE
    for rank in ranks:
        rank.join(max(0.0, deadline - time.monotonic()))
        if rank.exitcode is None:
            rank.kill()
            rank.join()


def _rank(target: str, argv: list[str], env: dict[str, str], log: str, cwd: str, parent: int) -> None:
    """One rank, in a process forked from the server: torchrun's environment, output to ``log``."""
    import faulthandler
    import threading

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    faulthandler.enable()
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
    import torch

    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    if target.endswith(".py"):
        import runpy

        sys.argv = [target, *argv]
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))  # as `python script.py` does
        runpy.run_path(target, run_name="__main__")
        return
    import importlib

    module, _, function = target.partition(":")
    sys.argv = [module, *argv]
    sys.exit(getattr(importlib.import_module(module), function)(argv) or 0)


def _exit_with(parent: int) -> None:
    """Ends this rank when the test process that started it is gone (no rank outlives it)."""
    while True:
        try:
            os.kill(parent, 0)
        except ProcessLookupError:
            os._exit(1)
        time.sleep(1.0)
