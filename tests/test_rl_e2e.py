"""The RL stack end to end on this CPU machine: real vLLM, the local launcher, the trainer and
the orchestrator as separate processes. Shortened versions of examples/cpu."""

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

from prime_core.testing import free_ports, inference_server, records
from prime_plugin_tasks.reverse_text import LEARNABLE, LEARNABLE_TASK

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "cpu"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.serial,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (scripts/install.sh)"),
]


def prime(*args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-m", "prime_core", *args], capture_output=True, text=True,
                            env=env, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"prime {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """The example's tiny model, untrained (LEARNABLE is a task it learns within a few steps):
    `prime model tiny`'s folder, built in this process (a `prime` process takes ~5 s to start)."""
    from prime_plugin_hf.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("model") / "tiny", hidden_size=128, num_layers=2)


@pytest.fixture
def server(tiny_model, tmp_path):
    """``prime inference`` on the tiny model with the example's inference settings, for a test
    whose runs (a run and its resume) share one vLLM server (``--no-inference``): each start of
    vLLM on this machine is ~30 s, and what such a test checks is not the server's start."""
    with inference_server(tiny_model, tmp_path / "server", "--model.dtype", "float32", "--model.enforce-eager",
                          "--model.max-model-len", "256", "--args", '{"block_size": 32}',
                          env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"}) as url:
        yield url


def rl_args(model: Path, out: Path, *extra: str) -> list[str]:
    return ["run", str(EXAMPLE / "rl.toml"), "--model.name", str(model), "--output-dir", str(out),
            "--inference.server.port", str(free_ports(1)), *extra]


def test_lora_rl_serves_each_adapter_and_learns(tiny_model, tmp_path):
    """LoRA end to end: the trainer publishes only adapters, vLLM serves each new one exactly
    (on policy, async_level = 0: every step's samples match the trainer's log-probabilities, so
    every adapter after the first is checked, not only the zero one), and the sampled reward rises.
    (LoRA learns LEARNABLE ten times slower than full training: 0.01 -> 0.05 in twenty steps,
    rises of 0.035-0.042 in eight runs here; one step behind the policy, 0.031-0.043 in seven
    runs and none in one CI run, whose reward fell to zero after step 9.)"""
    out = tmp_path / "rl"
    steps = 20
    prime(*rl_args(tiny_model, out, "--max-steps", str(steps), "--trainer.model.lora.rank", "8",
                   "--trainer.model.lora.alpha", "16", *LEARNABLE, "--trainer.optim.lr", "2e-2",
                   "--orchestrator.async-level", "0"))
    trainer, orchestrator = records(out, "trainer"), records(out, "orchestrator")
    assert [r["step"] for r in trainer] == list(range(1, steps + 1))
    final = out / "weights" / f"step_{steps}"
    assert sorted(p.name for p in final.iterdir()) == ["STABLE", "adapter_config.json", "adapter_model.safetensors",
                                                          "prime_plugins.json"]
    # one float32 process: FSDP would have nothing to do there, so only LoRA wraps the model
    assert "strategies lora, steps 1" in (out / "logs" / "trainer.log").read_text()
    assert f"as LoRA adapter {tiny_model}-lora-step-" in (out / "logs" / "orchestrator.log").read_text()
    kl = [r["mismatch_kl"] for r in trainer]
    assert [r["off_policy_max"] for r in trainer] == [0] * steps
    assert max(map(abs, kl)) < 1e-3, f"vLLM's adapters and the trainer disagree: mismatch_kl by step {kl}"
    versions = [r["weights_version"] for r in orchestrator]
    assert versions[-1] >= steps - 3
    probes = {r["weights_version"]: r["probe_logprob"] for r in orchestrator}
    assert probes[versions[-1]] != pytest.approx(probes[0], abs=1e-6), "outputs changed with the adapters"
    rewards = [r["reward"] for r in orchestrator]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    lengths = [round(r["completion_len"], 1) for r in orchestrator]
    assert last > first + 0.01, (f"sampled reward did not rise with LoRA: {first:.3f} -> {last:.3f} ({rewards}; "
                                 f"completion lengths {lengths})")


def test_moe_rl_with_expert_parallel_native_model(tmp_path):
    """A tiny Qwen3-MoE trained by the native implementation with EP = 2 over two trainer
    processes: every published version is a Hugging Face checkpoint vLLM loads (experts one
    tensor each), and vLLM's first samples score the same under the trainer."""
    from safetensors.torch import load_file

    from prime_plugin_hf.tiny import build_tiny

    model, out, steps = tmp_path / "moe", tmp_path / "rl", 4
    build_tiny(model, hidden_size=128, num_layers=2, num_experts=4)
    prime(*rl_args(model, out, "--max-steps", str(steps), "--deployment.num-train-gpus", "2",
                   "--trainer.model.impl", "custom", "--trainer.model.ep", "2", "--orchestrator.batch-size", "64"))
    log = (out / "logs" / "trainer.log").read_text()
    assert "strategies ep, fsdp" in log
    trainer, orchestrator = records(out, "trainer"), records(out, "orchestrator")
    assert [r["step"] for r in trainer] == list(range(1, steps + 1))
    assert abs(trainer[0]["mismatch_kl"]) < 1e-3, f"trainer and vLLM disagree: {trainer[0]['mismatch_kl']}"
    assert orchestrator[-1]["weights_version"] >= steps - 2, "inference loaded the published weights"
    published = load_file(out / "weights" / f"step_{steps}" / "model.safetensors")
    start = load_file(model / "model.safetensors")
    key = "model.layers.1.mlp.experts.3.down_proj.weight"
    assert published.keys() == start.keys() and published[key].shape == start[key].shape
    assert not published[key].equal(start[key]), "the experts trained"


def test_two_replicas_and_two_trainer_processes_learn_with_bounded_lag_and_a_dead_replica_stops_the_run(
        tiny_model, tmp_path):
    """The example's config on a task a random tiny model learns within a few steps (LEARNABLE),
    with inference.parallel.dp = 2 and the orchestrator's own consistent_hash router (two `prime
    inference` processes on consecutive ports with their own configs) and two trainer processes
    (gloo: the multi-process trainer learns like one). The sampled reward rises by far more than
    its noise, every step trains on policies within the async bound, and both replicas serve and
    load each new policy (the newest at each load). Then one replica dies, and with on_replica_failure = "stop" the run
    stops, naming it. (The vllm-router plugin's end-to-end test covers "continue".)"""
    # The reward rises from about step 8 (steps 10-12: 0.09, 0.14, 0.25 in three runs), so the
    # replica dies at 15, leaving the rise a margin over its noise.
    model, out, steps, kill_at = tiny_model, tmp_path / "rl", 30, 15
    port = free_ports(2)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    run = subprocess.Popen(
        [sys.executable, "-m", "prime_core", "run", str(EXAMPLE / "rl.toml"), "--model.name", str(model),
         "--output-dir", str(out), "--inference.server.port", str(port), "--inference.parallel.dp", "2",
         "--max-steps", str(steps), "--orchestrator.client.router", "consistent_hash",
         "--orchestrator.client.on-replica-failure", "stop", "--deployment.num-train-gpus", "2", *LEARNABLE],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 900
        while not any(r["step"] >= kill_at for r in records(out, "orchestrator")):
            assert run.poll() is None, run.stdout.read()
            assert time.monotonic() < deadline, "the run never reached the step where a replica dies"
            time.sleep(0.2)
        trained = records(out, "orchestrator")
        engine = subprocess.run(["pgrep", "-f", f"[a-z_.]*api_server .*--port {port + 1} "],
                                capture_output=True, text=True).stdout.split()
        assert len(engine) == 1, engine
        os.kill(int(engine[0]), signal.SIGKILL)
        output, _ = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode != 0 and "role 'inference[1]' exited with code 137" in output, output
    assert not subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split(), \
        "no process of the run outlives it"

    configs = out / "configs"
    replicas = [json.loads((configs / f"inference_{i}.json").read_text()) for i in (0, 1)]
    assert [(r["server"]["port"], r["parallel"]["dp"]) for r in replicas] == [(port, 1), (port + 1, 1)]
    client = json.loads((configs / "orchestrator.json").read_text())["client"]
    assert client["base_url"] == [f"http://127.0.0.1:{port}/v1", f"http://127.0.0.1:{port + 1}/v1"]
    assert {p.name for p in (out / "logs").glob("inference*.log")} == {"inference_0.log", "inference_1.log"}

    assert {p.name for p in (out / "logs" / "trainer").iterdir()} == {"rank_0.log", "rank_1.log"}
    assert "on 2 × cpu, strategies fsdp" in (out / "logs" / "trainer.log").read_text()

    # It learned, on both replicas, which both got every new policy.
    first, last = (sum(r["reward"] for r in rows) / 3 for rows in (trained[:3], trained[kill_at - 3:kill_at]))
    assert last > first + 0.1, f"reward did not rise: {first:.3f} in the first 3 steps, {last:.3f} before the kill"
    trainer = records(out, "trainer")
    bound = json.loads((configs / "orchestrator.json").read_text())["max_off_policy_steps"]
    assert [r["step"] for r in trainer] == list(range(1, len(trainer) + 1)) and len(trainer) >= kill_at - 1 - bound
    # Step 1 trains on samples of the very weights it holds: any gap is trainer/inference mismatch.
    assert abs(trainer[0]["mismatch_kl"]) < 1e-3, f"trainer and vLLM disagree: {trainer[0]['mismatch_kl']}"
    for r in trainer:
        versions = (r["policy_version_min"], r["policy_version_max"])
        assert 0 <= (r["step"] - 1) - versions[0] <= bound, f"step {r['step']} trained on policies {versions}"
        assert versions[1] <= r["step"] - 1, f"step {r['step']} trained on policies {versions}"
        assert r["wait_time"] >= 0 and r["publish_time"] >= 0, r
    assert max(r["off_policy_max"] for r in trained) <= bound
    assert any("weights_write_time" in r for r in trainer), "the background writes were timed"
    probes = {r["weights_version"]: r["probe_logprob"] for r in trained}
    assert probes[trained[-1]["weights_version"]] != pytest.approx(probes[0], abs=1e-6), "outputs changed"
    # A group is one session (one request for its first turns), hashed to one replica: a step's 8
    # groups can all land on one (1 step in 128), and a step's count is what finished since the
    # previous record (rollouts run ahead: a step may find its batch served already). So both
    # serving is asserted over the run, each about half (104 groups: 25-75% is over 5 standard
    # deviations), and every step reports both.
    served = {p: 0 for p in (port, port + 1)}
    for r in trained[2:kill_at]:
        assert r["replicas_up"] == 2, r
        served = {p: served[p] + r[f"replica_requests/127.0.0.1:{p}"] for p in served}
    assert all(0.25 < n / sum(served.values()) < 0.75 for n in served.values()), served
    log = (out / "logs" / "orchestrator.log").read_text()
    assert "inference backend: vllm (auto" in log
    # Each load takes the newest version published: one published while the one before it was
    # still loading is skipped (seen once: v8, then v10). The async bound keeps the loads close.
    loaded = [int(v) for v in re.findall(r"loaded policy v(\d+) into 2 inference server", log)]
    assert loaded[0] == 1 and all(a < b <= a + 1 + bound for a, b in zip(loaded, loaded[1:], strict=False)), loaded
    assert loaded[-1] >= kill_at - 1 - bound, loaded
    for p in (port, port + 1):
        served = (out / "logs" / f"vllm-{p}.log").read_text()
        assert served.count("POST /collective_rpc") >= len(loaded), f"replica on port {p} missed new weights"


def test_trainer_killed_mid_run_resumes_without_gap_or_repeat(tiny_model, server, tmp_path):
    """The trainer dies mid-run: ``prime run`` stops, naming it; ``--resume`` goes on from the last
    checkpoint, and every step is in the metrics once. The run and its resume sample from one
    server (``--no-inference``); on resume the orchestrator loads the checkpoint's policy into it."""
    out = tmp_path / "rl"
    steps = 12
    args = ["run", str(EXAMPLE / "rl.toml"), "--model.name", str(tiny_model), "--output-dir", str(out),
            "--no-inference", "--orchestrator.client.base-url", server, "--max-steps", str(steps),
            "--ckpt.interval", "3", *LEARNABLE_TASK]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    run = subprocess.Popen([sys.executable, "-m", "prime_core", *args], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 600
        while not any(r["step"] >= 5 for r in records(out, "trainer")):
            assert run.poll() is None, run.stdout.read()
            assert time.monotonic() < deadline, "the run never reached step 5"
            time.sleep(0.2)
        trainer_cmd = f"prime_core trainer {out / 'configs' / 'trainer.json'}"
        pid = int(subprocess.run(["pgrep", "-f", trainer_cmd], capture_output=True, text=True).stdout.split()[0])
        os.kill(pid, signal.SIGKILL)
        output, _ = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode != 0
    assert "role 'trainer' exited" in output, output

    killed_at = max(r["step"] for r in records(out, "trainer"))
    assert killed_at < steps
    prime(*args, "--resume")
    trainer_steps = [r["step"] for r in records(out, "trainer")]
    orchestrator_steps = [r["step"] for r in records(out, "orchestrator")]
    assert trainer_steps == list(range(1, steps + 1)), trainer_steps
    assert orchestrator_steps == list(range(1, steps + 1)), orchestrator_steps
    superseded = out / "metrics.superseded.jsonl"
    assert superseded.exists() or killed_at % 3 == 0, "redone steps were moved aside, not lost"

    # The server still holds the killed run's newest policy: the resumed orchestrator first loads
    # the policy of the step it resumes after, and the server serves it again (the same probe).
    before, after = (out / "logs" / "orchestrator.log").read_text().split("resuming at step ")
    start = int(after.split()[0])
    loaded = r"loaded policy v(\d+) into 1 inference server\(s\) \(probe logprob (-?[\d.]+)\)"
    first = {int(v): float(p) for v, p in re.findall(loaded, before)}
    version, probe = re.search(loaded, after).groups()
    assert int(version) == start - 1, (start, first, version)
    if start - 1 in first:  # the killed run had loaded it (a version published just before the kill may not be)
        assert float(probe) == pytest.approx(first[start - 1], abs=1e-4), (probe, first)


def test_port_in_use_stops_every_role(tiny_model, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = prime("run", str(EXAMPLE / "rl.toml"), "--model.name", str(tiny_model),
                       "--output-dir", str(tmp_path / "rl"), "--inference.server.port", str(port),
                       "--max-steps", "2", check=False, timeout=300)
    assert result.returncode != 0
    assert "role 'inference' exited" in result.stderr
    assert "inference.server.port" in result.stderr and str(port) in result.stderr


def test_server_that_never_becomes_healthy_times_out_clearly(tiny_model, tmp_path):
    result = prime(*rl_args(tiny_model, tmp_path / "rl", "--max-steps", "2", "--inference.startup-timeout", "3"),
                   check=False, timeout=300)
    assert result.returncode != 0
    assert "role 'inference' exited" in result.stderr
    assert "inference.startup_timeout" in result.stderr


def test_bad_input_stops_before_anything_starts(tiny_model, tmp_path):
    missing = prime("run", str(EXAMPLE / "rl.toml"), "--model.name", str(tmp_path / "nope"),
                    "--output-dir", str(tmp_path / "a"), check=False)
    assert missing.returncode == 2 and "model folder not found" in missing.stderr
    assert not (tmp_path / "a").exists()
    unknown_env = prime("run", str(EXAMPLE / "rl.toml"), "--model.name", str(tiny_model),
                        "--output-dir", str(tmp_path / "b"), "--orchestrator.env", '[{"id": "chess"}]', check=False)
    assert unknown_env.returncode == 2
    assert "orchestrator.env[0].id = 'chess': no installed plugin provides an environment" in unknown_env.stderr
    assert not (tmp_path / "b").exists()
