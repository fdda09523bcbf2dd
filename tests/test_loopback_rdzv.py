"""A one-node torchrun (how every launcher starts several trainer processes on one machine)
listens on loopback only: its rendezvous store (``prime_core.launch.loopback_rdzv``) and the
ranks' gloo sockets. ``torchrun --standalone`` would host the store on every interface."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

from prime_core.launch.lifeline import descendants
from prime_core.launch.plan import python_command

WORKER = textwrap.dedent("""
    import os, sys, time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    os.write(1, f"up {int(t.item())} {os.environ['MASTER_ADDR']}\\n".encode())  # one write: ranks share the pipe
    time.sleep(float(sys.argv[1]))
    from prime_core.distributed import exit_process, shutdown

    shutdown()
    exit_process(0)  # as a trainer rank ends: gloo's threads can abort a finalising interpreter
""")


def listening(pids: set[int]) -> set[tuple[str, int]]:
    """``(address, port)`` of every TCP socket these processes listen on."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = str(fd.readlink()) if fd.is_symlink() else ""
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = set()
    for table, size in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            hex_addr, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_addr)
            words = [raw[i:i + 4][::-1] for i in range(0, size, 4)]  # little-endian 32-bit words
            joined = b"".join(words)
            address = ".".join(str(b) for b in joined) if size == 4 else joined.hex()
            found.add((address, int(hex_port, 16)))
    return found


def test_one_node_torchrun_listens_on_loopback_only(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    # torchrun as a user starts it: nothing an earlier test left in this process (rank or prime
    # variables, signal dispositions or a blocked signal mask, which a child inherits) reaches it
    rank_vars = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items()
           if k not in rank_vars and not k.startswith(("TORCHELASTIC", "PRIME_"))}

    def fresh_signals() -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        for sig in (signal.SIGCHLD, signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)

    run = subprocess.Popen([*python_command(2), str(worker), "20"], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env=env, preexec_fn=fresh_signals,
                           start_new_session=True)
    processes: set[int] = {run.pid}
    try:
        ups, seen = 0, []
        deadline = time.monotonic() + 120
        while ups < 2:
            line = run.stdout.readline()
            seen.append(line)
            assert line and time.monotonic() < deadline, "the ranks did not come up:\n" + "".join(seen[-40:])
            ups += line.startswith("up 2 127.0.0.1")
        processes = {run.pid} | descendants(run.pid)
        sockets = listening(processes)
    finally:  # torchrun's ranks too: a SIGKILL to torchrun alone would leave them running
        run.terminate()
        run.wait()
        for pid in processes:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    assert sockets, "the run listens on something (its store)"
    loopback = {"127.0.0.1", "00000000000000000000000001000000"}  # IPv4, and IPv6 ::1
    assert {address for address, _ in sockets} <= loopback, sockets
