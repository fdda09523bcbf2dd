"""``prime inference`` with the transformers backend as a user starts it (a process of its own,
vLLM hidden so that ``auto`` picks this backend): many concurrent samples through the client,
weight updates, and SIGTERM ending the role with its port free and nothing left running."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prime_core.errors import PrimeError
from prime_core.inference.client import SampleRequest
from prime_core.testing import free_ports


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def role(tmp_path_factory):
    """A running ``prime inference`` process: ``(process, url, model folder, output_dir, stdout file)``."""
    from prime_plugin_hf.tiny import build_tiny

    root = tmp_path_factory.mktemp("server")
    model = build_tiny(root / "model", hidden_size=64, num_layers=2, dtype="float32")
    port, out = free_ports(1), root / "out"
    stdout = open(root / "stdout.txt", "w+")  # noqa: SIM115 - closed at the end of the module
    proc = subprocess.Popen([sys.executable, "-m", "prime_core", "inference", "--model.name", str(model),
                             "--model.dtype", "float32", "--server.port", str(port), "--output-dir", str(out)],
                            stdout=stdout, stderr=subprocess.STDOUT,
                            env={**os.environ, "PRIME_DISABLED_PLUGINS": "vllm", "HF_HUB_OFFLINE": "1"})
    try:
        deadline = time.monotonic() + 300
        while "inference ready at" not in Path(stdout.name).read_text():
            assert proc.poll() is None, Path(stdout.name).read_text()
            assert time.monotonic() < deadline, "not ready in 300 s"
            time.sleep(0.5)
        yield proc, f"http://127.0.0.1:{port}/v1", model, out, Path(stdout.name)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stdout.close()


def client(url: str):
    from prime_plugin_transformers.client import TransformersClient

    return TransformersClient(url, api_key=None, timeout=120.0)


def test_auto_says_it_picked_transformers_and_logs_under_output_dir(role):
    proc, url, model, out, stdout = role
    assert "starting transformers (auto: the available backend with the highest priority) server" in stdout.read_text()
    log = out / "logs" / f"transformers-{url.rsplit(':', 1)[1].removesuffix('/v1')}.log"
    assert f"serving {model} (cpu, float32" in log.read_text()
    assert client(url).health() is True


def test_hundreds_of_concurrent_samples_are_served(role):
    _, url, _, _, _ = role

    async def go():
        c = client(url)
        try:
            requests = [SampleRequest(prompt_ids=[5, 17, 42, i % 50 + 1], n=4, max_tokens=16, temperature=1.0)
                        for i in range(64)]
            return await asyncio.gather(*(c.sample(r) for r in requests))
        finally:
            await c.close()

    answers = asyncio.run(go())
    assert len(answers) == 64 and all(len(samples) == 4 for samples in answers)
    assert all(1 <= len(s.token_ids) <= 16 and len(s.logprobs) == len(s.token_ids) for a in answers for s in a)


def test_weights_are_updated_through_the_client_and_adapters_refused(role, tmp_path):
    from prime_core.testing.contracts.inference_backend import changed_checkpoint, reference_logprobs

    _, url, model, _, _ = role
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    changed = changed_checkpoint(model, tmp_path / "step_1")
    greedy = SampleRequest(prompt_ids=[5, 17, 42, 8], max_tokens=6, temperature=0.0)

    async def go():
        c = client(url)
        try:
            with pytest.raises(PrimeError, match="is a LoRA adapter, which this backend does not serve"):
                await c.load_weights(1, str(adapter))
            with pytest.raises(PrimeError, match=r"\(HTTP 400\): no weight files"):
                await c.load_weights(1, str(tmp_path))
            await c.load_weights(1, str(changed))
            return (await c.sample(greedy))[0]
        finally:
            await c.close()

    sample = asyncio.run(go())
    want = reference_logprobs(changed, greedy.prompt_ids, sample.token_ids)
    assert max(abs(a - b) for a, b in zip(sample.logprobs, want, strict=True)) < 2e-4


def test_sigterm_ends_the_role_with_code_0_and_frees_its_port(role):
    import psutil

    proc, url, _, _, stdout = role
    port = int(url.rsplit(":", 1)[1].removesuffix("/v1"))
    children = psutil.Process(proc.pid).children(recursive=True)
    assert children == []  # the server lives in the role's own process
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, stdout.read_text()
    assert port_is_free(port)
    assert client(url).health() is False
