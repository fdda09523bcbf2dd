"""The ``inference`` role: run the configured backend's server until it exits or we are told to stop.

The backend (``inference.backend``; ``auto``: the available one with the highest priority)
comes from a plugin. One process serves one replica (``parallel.dp = 1``; launchers start
one process per replica). SIGTERM (how launchers stop a role), SIGINT and SIGHUP stop the server
and end the role with exit code 0; a server that dies by itself ends it with the server's
exit code.
"""

from __future__ import annotations

import signal
import sys


class _Stop(Exception):
    pass


def _raise_stop(signum, frame):
    raise _Stop(signum)


def run(config) -> int:
    from prime_core.errors import PrimeError
    from prime_core.inference.backend import describe, select_backend

    if config.parallel.dp > 1:
        raise PrimeError(
            f"parallel.dp = {config.parallel.dp}: one inference role process serves one replica, but this "
            "process was started (as a launcher's role process) with the config of all replicas",
            hint="run the replica configs a launcher writes (configs/inference_0.json, ...), or type "
                 "`prime inference FILE` without PRIME_ROLE_PROCESS=1 so that a launcher starts every replica",
        )
    backend = select_backend(config.backend, key="inference.backend")
    server = backend.server(config)
    log = getattr(server, "log_path", None)
    previous = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        try:
            print(f"starting {describe(backend, config.backend)} server" + (f" (log: {log})" if log else ""),
                  flush=True)
            server.start()
            server.wait_healthy(config.startup_timeout)
            print(f"inference ready at {server.base_url}", flush=True)
            code = server.wait()
        except _Stop:
            return 0
        finally:
            # A second signal must not interrupt the clean-up.
            for sig in previous:
                signal.signal(sig, signal.SIG_IGN)
            server.stop()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code == 0:
        return 0
    code = 128 - code if code < 0 else code  # killed by a signal: the shell's convention
    print(f"error: the {backend.name} inference server exited with code {code}"
          + (f"; see its log: {log}" if log else ""), file=sys.stderr, flush=True)
    if log:
        from pathlib import Path

        from prime_core.launch.supervise import failure_report

        print(failure_report(Path(log), since=getattr(server, "log_start", 0)), file=sys.stderr, flush=True)
    return code
