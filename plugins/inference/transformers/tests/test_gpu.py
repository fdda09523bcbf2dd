"""The transformers backend on one GPU: a short ``prime run`` with inference and trainer sharing
the GPU logs rewards and serves the trainer's new weights, and the server stays within its
``gpu_memory_utilization`` share. Marked ``gpu``: skipped (with the reason) without CUDA."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

CONFIG = """
max_steps = 3
seq_len = 1024

[trainer.model]
impl = "hf"

[trainer.optim]
lr = 1e-4

[orchestrator]
batch_size = 64
rollouts_per_example = 8
async_level = 1

[orchestrator.sampling]
temperature = 1.0
max_tokens = 32

[[orchestrator.env]]
id = "reverse_text"

[inference]
backend = "transformers"
gpu_memory_utilization = 0.2

[inference.model]
dtype = "bfloat16"
max_model_len = 1024

[deployment]
inference_gpu_ids = [0]
trainer_gpu_ids = [0]
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from prime_plugin_hf.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("gpu") / "model", hidden_size=256, num_layers=4, head_dim=64,
                      dtype="bfloat16")


@pytest.mark.parametrize("transport", ["filesystem", "ipc"])
def test_a_short_rl_run_on_one_shared_gpu_logs_rewards_and_updates_weights(model, tmp_path, transport):
    short_run(model, tmp_path, transport)


def test_on_two_gpus_the_weights_are_broadcast_over_nccl_into_the_server(model, tmp_path):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs (trainer and inference each on its own: NCCL takes one rank per GPU)")
    pytest.importorskip("prime_plugin_vllm", reason="the nccl transport is prime-plugin-vllm's")
    short_run(model, tmp_path, "nccl", "--deployment.trainer-gpu-ids", "[1]")


def short_run(model, tmp_path, transport: str, *more: str) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    (tmp_path / "rl.toml").write_text(CONFIG)
    out = tmp_path / "rl"
    run = subprocess.run([sys.executable, "-m", "prime_core", "run", str(tmp_path / "rl.toml"), "--model.name",
                          str(model), "--output-dir", str(out), "--inference.server.port", str(port),
                          "--weight-broadcast.type", transport, *more],
                         capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    trainer = [r for r in rows if r["role"] == "trainer"]
    orchestrator = [r for r in rows if r["role"] == "orchestrator"]
    assert len(trainer) == 3 and all(r["reward"] == r["reward"] for r in orchestrator)  # logged, not NaN
    server_log = (out / "logs" / f"transformers-{port}.log").read_text()
    assert f"serving {model} (cuda, bfloat16" in server_log
    assert "loaded weights of step 1 from" in server_log
    assert ("shared through CUDA IPC" in server_log) == (transport == "ipc")
    assert ("received over nccl" in server_log) == (transport == "nccl")
    probes = {r["weights_version"]: r["probe_logprob"] for r in orchestrator}
    assert max(probes) >= 1 and probes[max(probes)] != pytest.approx(probes[0], abs=1e-6), probes
    print(f"bf16 on-policy mismatch KL of step 1: {trainer[0]['mismatch_kl']:.3e}")
    assert trainer[0]["mismatch_kl"] < 1e-2


def test_the_server_stays_within_its_gpu_memory_share(model, tmp_path):
    import torch

    from prime_core.cli.common import load_config
    from prime_plugin_transformers.engine import Engine

    config = load_config("inference", ["--model.name", str(model), "--backend", "transformers", "--output-dir",
                                       str(tmp_path), "--gpu-memory-utilization", "0.25"])
    engine = Engine(config)
    engine.load()
    try:
        engine.sample({"prompt_ids": list(range(5, 100)), "n": 64, "max_tokens": 64, "temperature": 1.0})
        _, total = torch.cuda.mem_get_info()
        held = torch.cuda.max_memory_reserved()
        assert held <= 0.25 * total, f"{held / 2**30:.2f} GiB held, over 0.25 of {total / 2**30:.1f} GiB"
        assert held >= 0.1 * total, f"only {held / 2**30:.2f} GiB held: the KV cache was not sized from the share"
    finally:
        engine.stop()


@pytest.mark.parametrize("attention", ["prime_varlen", "sdpa"])
def test_sampled_logprobs_match_a_plain_forward_pass(model, tmp_path, attention):
    """Continuous batching on torch's flash varlen kernel (the default on a GPU) and on paged sdpa:
    the log-probabilities of the sampled tokens, from concurrent requests of different lengths,
    against one plain forward pass of prompt and completion (transformers' sdpa, no cache)."""
    from concurrent.futures import ThreadPoolExecutor

    from prime_core.cli.common import load_config
    from prime_plugin_transformers.engine import Engine

    config = load_config("inference", ["--model.name", str(model), "--backend", "transformers", "--output-dir",
                                       str(tmp_path), "--gpu-memory-utilization", "0.2", "--model.dtype", "bfloat16",
                                       "--args", json.dumps({"attn_implementation": attention})])
    engine = Engine(config)
    engine.load()
    try:
        assert engine.model.config._attn_implementation.removeprefix("paged|") == attention
        prompts = [[(7 * i + j) % 200 + 5 for j in range(3 + 37 * i)] for i in range(8)]
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(lambda p: engine.sample({"prompt_ids": p, "n": 4, "max_tokens": 40,
                                                             "temperature": 1.0}), prompts))
        diffs = []
        with engine._exclusive():
            for prompt, samples in zip(prompts, answers, strict=True):
                for s in samples:
                    reference = engine._logprobs(prompt, s["token_ids"])
                    diffs += [abs(a - b) for a, b in zip(s["logprobs"], reference, strict=True)]
    finally:
        engine.stop()
    mean, worst = sum(diffs) / len(diffs), max(diffs)
    print(f"{attention}: {len(diffs)} sampled tokens, |logprob - plain forward| mean {mean:.2e}, max {worst:.2e}")
    assert mean < 2e-2 and worst < 0.5
