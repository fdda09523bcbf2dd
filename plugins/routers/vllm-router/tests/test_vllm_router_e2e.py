"""RL with two real vLLM replicas behind a real vllm-router, on this CPU machine: the policy
learns, both engines serve and load each new policy (weight updates go to each engine, not
through the router), the router keeps a session on one engine (X-Session-ID), and when one
engine dies mid-run the router and the orchestrator leave it out and the run goes on with the
other (``orchestrator.client.on_replica_failure = "continue"``, the default).

One run covers all of it: two vLLM servers on two cores are slow to start, and the run is
where each of these can break. The signal is strong on purpose: a random tiny model learns to
answer with the two letters of ``reverse_text`` strings over "ab" (partial credit), so the
reward climbs within a few steps.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prime_core.testing import free_ports, records
from prime_plugin_tasks.reverse_text import LEARNABLE

ROOT = Path(__file__).resolve().parents[4]
EXAMPLE = ROOT / "examples" / "cpu" / "rl.toml"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.serial,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (scripts/install.sh)"),
]

def newest_loaded(log: Path) -> int:
    """The newest policy version the orchestrator's log says it loaded (0 before any)."""
    found = re.findall(r"loaded policy v(\d+) ", log.read_text()) if log.exists() else []
    return max(map(int, found), default=0)


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def test_rl_behind_vllm_router_learns_on_both_engines_and_goes_on_without_a_dead_one(tmp_path):
    from prime_plugin_hf.tiny import build_tiny

    model, out, steps, kill_at = tmp_path / "tiny", tmp_path / "rl", 16, 8
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("VLLM_API_KEY", None)
    build_tiny(model, hidden_size=128, num_layers=2)  # `prime model tiny`'s, without a ~5 s process start
    port = free_ports(4)  # two engines, the router, its metrics
    dead, alive = port + 1, port
    run = subprocess.Popen(
        [sys.executable, "-m", "prime_core", "run", str(EXAMPLE), "--model.name", str(model), "--output-dir", str(out),
         "--inference.server.port", str(port), "--inference.parallel.dp", "2", "--max-steps", str(steps),
         "--inference.router.policy", "consistent_hash", "--inference.router.log-level", "info", *LEARNABLE],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline, log = time.monotonic() + 900, out / "logs" / "orchestrator.log"
        # Right after a new policy is loaded, when the requests sampled with it are in flight. (A
        # load takes the newest version published, so one published during a load is skipped.)
        while newest_loaded(log) < kill_at:
            assert run.poll() is None, run.stdout.read()
            assert time.monotonic() < deadline, "the run never reached the step where an engine dies"
            time.sleep(0.05)
        # One engine dies (its vLLM API server, as in a crash); its `prime inference` role follows.
        engine = subprocess.run(["pgrep", "-f", f"[a-z_.]*api_server .*--port {dead} "],
                                capture_output=True, text=True).stdout.split()
        assert len(engine) == 1, engine
        os.kill(int(engine[0]), signal.SIGKILL)
        killed = time.time()
        output, _ = run.communicate(timeout=900)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, output
    left = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert not left, f"processes of the run outlived it: {left}"
    for served in (port + 2, port + 3):  # the router (whose command line no longer names output_dir), its metrics
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", served), timeout=2).close()

    trainer, orchestrator = records(out, "trainer"), records(out, "orchestrator")
    assert [r["step"] for r in trainer] == [r["step"] for r in orchestrator] == list(range(1, steps + 1))
    assert abs(trainer[0]["mismatch_kl"]) < 1e-3, "the engines sample what the trainer scores"
    first, last = mean(r["reward"] for r in orchestrator[:3]), mean(r["reward"] for r in orchestrator[-3:])
    assert last > first + 0.1, f"reward did not rise: first 3 steps {first:.3f}, last 3 steps {last:.3f}"

    # Both engines served while both lived (each engine's own count), then the one left did.
    served = [(r["step"], r.get(f"replica_requests/127.0.0.1:{alive}"), r.get(f"replica_requests/127.0.0.1:{dead}"))
              for r in orchestrator]
    # Steps before the one whose policy was loaded when the engine died: sampled while both lived.
    before = [s for s in served if 3 <= s[0] < kill_at]
    assert all(orchestrator[step - 1]["time"] < killed for step, _, _ in before), (killed, orchestrator)
    # A group is one session, which the router keeps on one engine: a step's 8 groups can all go to
    # one (1 step in 128). And a step's count is what finished since the previous record: with
    # rollouts running ahead of the trainer, a step can find its batch already served (0, 0). So
    # each engine's share is taken over the steps while both lived, and each step must report both.
    assert before and all(a is not None and d is not None for _, a, d in before), served
    alive_share = sum(a for _, a, _ in before) / sum(a + d for _, a, d in before)
    assert 0.2 < alive_share < 0.8, served
    assert orchestrator[-1]["replicas_up"] == 1 and sum(s[1] for s in served[-3:]) > 0, served
    assert sum(r["env_errors"] + r["failed_groups"] for r in orchestrator) == 0, "no rollout was lost"

    # The base model, then each new policy, reached each engine alive (straight, not through the router).
    log = (out / "logs" / "orchestrator.log").read_text()
    assert "loaded the base model (policy v0) into 2 inference server(s)" in log
    loads = re.findall(r"loaded policy v(\d+) into (\d) inference server", log)
    versions = [int(v) for v, _ in loads]
    bound = json.loads((out / "configs" / "orchestrator.json").read_text())["max_off_policy_steps"]
    # Increasing, each within the async bound of the one before (a version published while the
    # one before it loaded is skipped), up to what the last batch needed.
    assert versions[0] == 1 and all(a < b <= a + 1 + bound for a, b in zip(versions, versions[1:], strict=False)), loads
    assert versions[-1] >= steps - 1 - bound, loads
    both = sum(n == "2" for _, n in loads)
    assert versions[both - 1] >= kill_at and {n for _, n in loads[both:]} == {"1"}, loads
    updates = {p: (out / "logs" / f"vllm-{p}.log").read_text().count("POST /collective_rpc") for p in (alive, dead)}
    # One more than logged where a load was under way when the run ended (or the engine died).
    assert 1 + len(loads) <= updates[alive] <= 2 + len(loads) and 1 + both <= updates[dead] <= 2 + both, \
        (updates, loads)
    assert "/collective_rpc" not in (out / "logs" / "vllm-router.log").read_text()

    # The router kept a session on one engine: the probe's requests, one per version.
    routed = re.findall(r"key='header:x-session-id:([^']+)' -> worker='http://127.0.0.1:(\d+)'",
                        (out / "logs" / "vllm-router.log").read_text())
    probe = [int(p) for s, p in routed if s == "probe"]
    assert len(probe) >= both and len(set(probe[:both])) == 1, probe
    assert {int(p) for s, p in routed if s.startswith("group-")} == {alive, dead}, "sessions spread over both"

    # The dead engine was said to be dead, and left out.
    assert (f"warning: inference replica http://127.0.0.1:{dead}/v1 stopped answering its health check: going on "
            "with 1 of 2 replica(s) (orchestrator.client.on_replica_failure = 'continue')") in log
    assert "warning: role 'inference[1]' exited with code" in output and "the run goes on without it" in output
    assert "replicas 2/2 up, requests " in output and "replicas 1/2 up" in output, "the progress line says so"
