"""Free local ports, for tests and benchmarks that start servers (no pytest import here: the
benchmarks run where pytest is not installed)."""

from __future__ import annotations

import socket


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports free on 127.0.0.1 (replicas and a teacher server
    take port, port + 1, ...)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        try:
            for port in range(first + 1, first + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports")
