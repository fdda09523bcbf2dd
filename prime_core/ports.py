"""Free local ports, for tests and benchmarks that start servers (no pytest import here: the
benchmarks run where pytest is not installed)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 10000


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports free on 127.0.0.1 (replicas and a teacher server
    take port, port + 1, ...).

    The ports lie below the kernel's ephemeral range: a port the OS hands out for ``bind(0)``
    or an outgoing connection is in that range, so a vLLM engine's ZMQ sockets or a process
    group's store, started before our server binds, cannot take the port picked for it."""
    low, high = _ephemeral_range()
    if low - count > LOWEST:
        bottom, top = LOWEST, low - count
    else:  # an ephemeral range set to start low: pick above it
        bottom, top = high + 1, 65536 - count
    for _ in range(200):
        first = random.randint(bottom, top)
        try:
            for port in range(first, first + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports between {bottom} and {top + count}")
