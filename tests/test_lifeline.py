"""Roles die with their launcher, whatever ends it: a launcher supervising a role that binds a
port and a role run under torchrun (ranks are the launcher's grandchildren) is killed with
SIGKILL, or hung up (SIGHUP, a closed terminal); no process and no bound port remain.

The end-to-end version, ``prime run`` with real vLLM, is in ``test_rl_e2e.py``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from prime_core.launch import lifeline
from prime_core.testing import free_ports

LAUNCHER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from prime_core.launch.plan import LaunchPlan, RoleProcess
    from prime_core.launch.supervise import supervise

    out, port, worker = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    server = [sys.executable, "-c", (
        "import socket, time\\n"
        "from prime_core.launch.lifeline import watch_launcher\\n"
        "watch_launcher()\\n"
        "s = socket.socket(); s.bind(('127.0.0.1', %s)); s.listen()\\n"
        "print('listening', flush=True)\\n"
        "time.sleep(600)\\n") % port]
    ranks = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", worker]
    plan = LaunchPlan(launcher="test", output_dir=out, processes=[
        RoleProcess(role="server", command=server, config=out, log=out / "server.log", service=True),
        RoleProcess(role="ranks", command=ranks, config=out, log=out / "ranks.log"),
    ])
    print(supervise(plan).code, flush=True)
""")
WORKER = textwrap.dedent("""
    import os, time
    from prime_core.launch.lifeline import watch_launcher
    watch_launcher()
    # One string: unbuffered, the two ranks' print() pieces interleaved ("rankrank 1  0up")
    print(f"rank {os.environ['RANK']} up", flush=True)
    time.sleep(600)
""")


def running(pids: set[int]) -> set[int]:
    return {pid for pid in pids if lifeline.start_time(pid) is not None}


def port_bound(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def wait_for(what: str, condition, timeout: float) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, f"{what} within {timeout:g} s"
        time.sleep(0.1)
    return time.monotonic() - start


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP], ids=["SIGKILL", "SIGHUP"])
def test_every_role_and_rank_dies_with_the_launcher(tmp_path, sig):
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    (tmp_path / "worker.py").write_text(WORKER)
    port = free_ports(1)
    launcher = subprocess.Popen([sys.executable, str(tmp_path / "launcher.py"), str(tmp_path), str(port),
                                 str(tmp_path / "worker.py")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    roles: set[int] = set()
    try:
        wait_for("the server's port bound and both ranks up", lambda: port_bound(port) and (
            tmp_path / "ranks.log").is_file() and (tmp_path / "ranks.log").read_text().count(" up") == 2, 120)
        roles = lifeline.descendants(launcher.pid)
        assert len(roles) >= 4, roles  # the server, torchrun and its two ranks
        launcher.send_signal(sig)
        took = wait_for("no role process left", lambda: not running(roles), 15)
        wait_for("the port free", lambda: not port_bound(port), 5)
    finally:  # nothing of this test outlives it, whatever failed
        for pid in running(roles | lifeline.descendants(launcher.pid)):
            os.kill(pid, signal.SIGKILL)
        launcher.kill()
        launcher.wait()
    print(f"{sig.name}: every role gone {took:.1f} s after the launcher")


def test_identity_names_this_process_and_not_a_recycled_pid():
    me = lifeline.identity()
    assert lifeline.alive(me)
    pid, started = me.split(":")
    assert not lifeline.alive(f"{pid}:{int(started) + 1}")  # same pid, another process
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not lifeline.alive(lifeline.identity(child.pid))
