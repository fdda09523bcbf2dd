"""``prime run`` with real vLLM, ended from outside: killed with SIGKILL or hung up (a closed
terminal), no role process and no bound port remain within seconds; a vLLM server that dies
mid-run is reported as the cause, with its own log, and the rest is stopped."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prime_core.launch import lifeline
from prime_core.testing import free_ports

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "cpu" / "rl.toml"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.serial,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (scripts/install.sh)"),
]


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def alive(pids: set[int]) -> set[int]:
    return {pid for pid in pids if lifeline.start_time(pid) is not None}


def wait_for(what: str, condition, timeout: float, run: subprocess.Popen | None = None) -> float:
    start = time.monotonic()
    while not condition():
        if run is not None and run.poll() is not None:
            pytest.fail(f"prime run ended (code {run.returncode}) before {what}:\n{run.stdout.read()}")
        assert time.monotonic() - start < timeout, f"{what} within {timeout:g} s"
        time.sleep(0.2)
    return time.monotonic() - start


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from prime_plugin_hf.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("model") / "tiny", hidden_size=64, num_layers=2)


def start_run(model: Path, out: Path, port: int, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "prime_core", "run", str(EXAMPLE), "--model.name", str(model),
               "--output-dir", str(out), "--inference.server.port", str(port), "--max-steps", "50",
               "--orchestrator.batch-size", "16", *extra]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})


def cleanup(pids: set[int]) -> None:
    for pid in alive(pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP], ids=["SIGKILL", "SIGHUP"])
def test_prime_run_killed_leaves_no_role_and_no_port(model, tmp_path, sig):
    """Inference (vLLM: its API server and engine core), the orchestrator and a trainer of two
    torchrun ranks, all started by `prime run`, end with it."""
    port, out = free_ports(1), tmp_path / "rl"
    run = start_run(model, out, port, "--deployment.num-train-gpus", "2")
    roles: set[int] = set()
    try:
        wait_for("vLLM serving and both trainer ranks up", lambda: listening(port) and (
            out / "logs" / "trainer" / "rank_1.log").exists(), 600, run)
        roles = lifeline.descendants(run.pid)
        assert len(roles) >= 7, roles  # inference + vLLM's API server and engine, orchestrator, torchrun + 2 ranks
        run.send_signal(sig)
        took = wait_for("every role process gone", lambda: not alive(roles), 30)
        wait_for("the port free", lambda: not listening(port), 5)
    finally:
        cleanup(roles | lifeline.descendants(run.pid))
        run.kill()
        run.wait()
    print(f"{sig.name}: {len(roles)} role processes gone {took:.1f} s after the launcher")


def test_a_dead_vllm_server_is_named_with_its_own_log(model, tmp_path):
    """vLLM's API server killed mid-run: the run stops, blaming inference (not the orchestrator
    its death left without answers), with vLLM's log; no process remains."""
    port, out = free_ports(1), tmp_path / "rl"
    run = start_run(model, out, port)
    roles: set[int] = set()
    try:
        def sampled() -> bool:
            # The inference role's own health check too: on a loaded machine the orchestrator can
            # step before the role has seen /health answer, and then the role's message is "exited
            # before becoming healthy" (seen in CI).
            path, role_log = out / "metrics.jsonl", out / "logs" / "inference.log"
            return path.exists() and any(json.loads(line).get("role") == "orchestrator"
                                         for line in path.read_text().splitlines() if line.strip()) \
                and role_log.exists() and "inference ready at" in role_log.read_text()

        wait_for("the first orchestrator step", sampled, 600, run)
        roles = lifeline.descendants(run.pid)
        servers = [pid for pid in roles if f"--port\x00{port}" in Path(f"/proc/{pid}/cmdline").read_text()
                   and "api_server" in Path(f"/proc/{pid}/cmdline").read_text()]
        assert len(servers) == 1, servers
        os.kill(servers[0], signal.SIGKILL)
        output, _ = run.communicate(timeout=120)
        wait_for("every role process gone", lambda: not alive(roles), 30)
    finally:
        cleanup(roles | lifeline.descendants(run.pid))
        if run.poll() is None:
            run.kill()
        run.wait()
    assert run.returncode != 0
    assert "role 'inference' exited" in output, output
    assert f"the vllm inference server exited with code 137; see its log: {out / 'logs' / f'vllm-{port}.log'}" \
        in output, output
