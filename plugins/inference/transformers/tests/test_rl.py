"""``prime run`` end to end with the transformers backend on this CPU machine, vLLM hidden so
that ``auto`` picks it: the inference log-probabilities agree with the trainer's (the first
step's on-policy mismatch KL), new weights reach inference and change its outputs, and nothing
is left running; with weights through the filesystem, shared memory (``ipc``) and the process
group broadcast (``nccl``, over gloo here)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest

from prime_core.testing import free_ports

pytestmark = pytest.mark.slow

CONFIG = """
max_steps = 4
seq_len = 512

[trainer.model]
impl = "hf"
dtype = "float32"

[trainer.optim]
lr = 1e-3
weight_decay = 0.0

[orchestrator]
batch_size = 64
rollouts_per_example = 8
max_off_policy_steps = 2
async_level = 1

[orchestrator.sampling]
temperature = 1.0
max_tokens = 6

[[orchestrator.env]]
id = "arithmetic"
args = { digits = 1 }

[inference.model]
dtype = "float32"
max_model_len = 256
"""


def prime(*args: str, hide_vllm: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PRIME_DISABLED_PLUGINS": "vllm" if hide_vllm else ""}
    return subprocess.run([sys.executable, "-m", "prime_core", *args], capture_output=True, text=True, env=env,
                          timeout=900)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """`prime model tiny --hidden-size 128 --num-layers 2`'s folder, built once in this process
    (a `prime` process takes ~5 s to start); the runs only read it."""
    from prime_plugin_hf.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny") / "model", hidden_size=128, num_layers=2)


@pytest.mark.parametrize("transport", ["filesystem", "ipc", "nccl"])
def test_a_short_rl_run_samples_what_the_trainer_computes_and_updates_inference(model, tmp_path, transport):
    """``nccl`` (gloo here) is prime-plugin-vllm's transport: that plugin stays, and the backend is named."""
    if transport == "nccl":
        pytest.importorskip("prime_plugin_vllm", reason="the nccl transport is prime-plugin-vllm's")
    out, port = tmp_path / "rl", free_ports(1)
    (tmp_path / "rl.toml").write_text(CONFIG)
    backend = ["--inference.backend", "transformers"] if transport == "nccl" else []
    run = prime("run", str(tmp_path / "rl.toml"), "--model.name", str(model), "--output-dir", str(out),
                "--inference.server.port", str(port), "--weight-broadcast.type", transport, *backend,
                hide_vllm=transport != "nccl")
    assert run.returncode == 0, run.stdout + run.stderr

    inference_log = (out / "logs" / "inference.log").read_text()
    assert ("starting transformers server" if backend else
            "starting transformers (auto: the available backend with the highest priority) server") in inference_log
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    trainer = [r for r in rows if r["role"] == "trainer"]
    orchestrator = [r for r in rows if r["role"] == "orchestrator"]
    assert [r["step"] for r in trainer] == [1, 2, 3, 4] and len(orchestrator) == 4
    # Step 1 trains on samples of the very weights it starts from: any gap is the two engines'.
    assert trainer[0]["policy_version_max"] == 0 and trainer[0]["mismatch_kl"] < 1e-3
    assert all(r["reward"] == r["reward"] for r in orchestrator)  # logged (not NaN)

    server_log = (out / "logs" / f"transformers-{port}.log").read_text()
    # the newest version when the orchestrator asks: with async_level 1 that may be step 1 or 2
    assert re.search(r"loaded weights of step [12] from", server_log) and "served " in server_log
    if transport != "filesystem":
        assert {"ipc": "shared through a shared file", "nccl": "received over gloo"}[transport] in server_log
        assert not list((out / "weights").glob("step_*/*.safetensors"))  # no version went through files
    probes = {r["weights_version"]: r["probe_logprob"] for r in orchestrator}
    assert max(probes) >= 1 and probes[max(probes)] != pytest.approx(probes[0], abs=1e-6), probes

    with socket.socket() as sock:  # the server's port is free again: nothing outlived the run
        sock.bind(("127.0.0.1", port))
