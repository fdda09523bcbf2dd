"""Acceptance of ``weight_broadcast.type = "nccl"`` on this CPU machine (gloo): ``prime run`` on
a tiny model with two vLLM replicas trains, and trainer rank 0 broadcasts every version into
both; what vLLM samples after each update scores the same under the trainer (the new weights,
exactly), the probe's output changes, nothing goes through safetensors, and requests running
on a server while its weights change are held and finish."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from prime_core.testing import free_ports, records

ROOT = Path(__file__).resolve().parents[4]
EXAMPLE = ROOT / "examples" / "cpu" / "rl.toml"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.serial,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (scripts/install.sh)"),
]


class LongRequests(threading.Thread):
    """Back-to-back long completions on one server for as long as the run goes: whenever the
    weights change, one of them is in flight."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.done, self.results, self.errors = url, threading.Event(), [], []

    def run(self) -> None:
        import httpx

        with httpx.Client(timeout=600, trust_env=False) as client:
            while not self.done.is_set():
                try:
                    if client.get(self.url.removesuffix("/v1") + "/health").status_code != 200:
                        raise httpx.HTTPError("not healthy yet")
                except httpx.HTTPError:
                    time.sleep(0.5)
                    continue
                body = {"model": client.get(f"{self.url}/models").json()["data"][0]["id"],
                        "prompt": [17, 42, 99, 5], "max_tokens": 200, "ignore_eos": True, "temperature": 1.0}
                started = time.time()
                try:
                    answer = client.post(f"{self.url}/completions", json=body)
                except httpx.HTTPError as exc:
                    self.errors.append((time.time(), repr(exc)))
                    return
                if answer.status_code != 200:
                    self.errors.append((time.time(), answer.text[:300]))
                    continue
                choice = answer.json()["choices"][0]
                self.results.append((started, time.time(), choice["finish_reason"],
                                     answer.json()["usage"]["completion_tokens"]))


def test_rl_with_weights_broadcast_over_gloo_into_two_vllm_replicas(tmp_path):
    from prime_plugin_hf.tiny import build_tiny

    model, out, steps = tmp_path / "tiny", tmp_path / "rl", 4
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    build_tiny(model, hidden_size=128, num_layers=2)  # `prime model tiny`'s, without a ~5 s process start
    port = free_ports(2)
    long_requests = LongRequests(f"http://127.0.0.1:{port}/v1")
    long_requests.start()
    try:
        run = subprocess.run(
            [sys.executable, "-m", "prime_core", "run", str(EXAMPLE), "--model.name", str(model),
             "--output-dir", str(out), "--inference.server.port", str(port), "--inference.parallel.dp", "2",
             "--max-steps", str(steps), "--weight-broadcast.type", "nccl", "--weight-broadcast.timeout", "300",
             # every batch sampled by the newest policy: the trainer scores exactly what vLLM served
             "--orchestrator.async-level", "0",
             "--orchestrator.env", '[{"id": "reverse_text", "args": {"alphabet": "ab", "min_len": 4, "max_len": 4}}]',
             "--trainer.optim.lr", "3e-3", "--trainer.scheduler.warmup-steps", "0", "--orchestrator.batch-size", "32",
             "--inference.env", '{"VLLM_CPU_OMP_THREADS_BIND": "nobind"}'],
            capture_output=True, text=True, env=env, timeout=1200)
    finally:
        long_requests.done.set()
        long_requests.join(60)
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-3000:]

    trainer, orchestrator = records(out, "trainer"), records(out, "orchestrator")
    assert [r["step"] for r in trainer] == list(range(1, steps + 1))
    for r in trainer:  # vLLM's log-probabilities of its samples are the trainer's under the broadcast weights
        assert r["policy_version_min"] == r["policy_version_max"] == r["step"] - 1, r
        assert abs(r["mismatch_kl"]) < 1e-5, f"step {r['step']}: trainer and vLLM disagree: {r['mismatch_kl']}"
    assert all(r["request_retries"] == 0 and r["failed_groups"] == 0 for r in orchestrator)

    log = (out / "logs" / "orchestrator.log").read_text()
    loaded = [int(v) for v in re.findall(r"loaded policy v(\d+) into 2 inference server", log)]
    assert loaded == list(range(1, steps + 1)), loaded  # every version, the last one too, into both
    probes = [float(p) for p in re.findall(r"probe logprob (-?[\d.]+)", log)]
    assert len(set(probes)) > 1, f"vLLM's outputs never changed: {probes}"
    sent = (out / "logs" / "trainer.log").read_text()
    assert "weight broadcast: gloo group" in sent and f"broadcast policy v{steps}:" in sent
    assert "to 2 inference worker(s)" in sent
    for step in range(steps - 2, steps + 1):
        folder = out / "weights" / f"step_{step}"
        names = sorted(p.name for p in folder.iterdir())
        assert names == ["BROADCAST.json", "STABLE", "prime_plugins.json"], f"no safetensors: {names}"
    # The replica without the long requests resets its prefix cache after every update (the
    # other one refuses while they run: per-version cache_salt keeps new requests off old blocks).
    assert (out / "logs" / f"vllm-{port + 1}.log").read_text().count("Successfully reset prefix cache") >= steps

    # Requests cut off when the run stopped the servers, after the trainer's last broadcast, are not
    # failures (an error, or an answer vLLM aborted on shutdown).
    end = max(r["time"] for r in trainer)
    assert not [e for e in long_requests.errors if e[0] < end], long_requests.errors
    finished = [r for r in long_requests.results if r[1] < end]
    assert all(r[2:] == ("length", 200) for r in finished), long_requests.results
    # The trainer's broadcast of version k ran in the publish_time before its record; vLLM took the
    # weights then. A request that began before and ended after it was in flight across the change.
    updates = [(r["time"] - r["publish_time"], r["time"]) for r in trainer]
    spanned = [u for u in updates if any(r[0] < u[0] and r[1] > u[1] for r in finished)]
    assert spanned, f"no long request was running while the weights changed: {updates} {long_requests.results}"
