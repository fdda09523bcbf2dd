"""The orchestrator's side of the inference contract, without a server: it samples only
through the backend's client (one per replica URL), the router picks each replica and hears
every outcome, weights reach every replica, and ``auto`` picks the backend by priority.

The backend here is ``CannedBackend``: its client returns fixed tokens and records the calls.
It tests orchestrator logic only; the real client is tested against a real vLLM server in
``plugins/inference/vllm/tests/test_vllm_server.py``.
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from prime_core import hookimpl
from prime_core.errors import PluginError, PrimeError
from prime_core.inference.client import InferenceClient, Sample, SampleRequest
from prime_core.orchestrator.batch import batch_file, read_batch
from prime_core.orchestrator.config import OrchestratorConfig
from prime_core.orchestrator.env import Task
from prime_core.specs import Environment, InferenceBackend, Router

pytest_plugins = ["prime_core.testing"]

URLS = ["http://replica-a:1/v1", "http://replica-b:2/v1"]


class CannedClient:
    """Answers every request with ``n`` copies of three fixed tokens; records everything."""

    def __init__(self, base_url, *, api_key, timeout, log, fail=False):
        self.base_url, self.api_key, self.timeout, self.log, self.fail = base_url, api_key, timeout, log, fail
        self.step = 0

    def health(self) -> bool:
        self.log.append(("health", self.base_url))
        return True

    async def sample(self, request: SampleRequest) -> list[Sample]:
        self.log.append(("sample", self.base_url, request))
        await asyncio.sleep(0)
        if self.fail:
            raise PrimeError(f"sampling at {self.base_url} failed (HTTP 500): boom")
        return [Sample(token_ids=[65, 66, 2], logprobs=[-0.5, -0.25, -0.125 * (1 + self.step)], finish_reason="stop",
                       text="ab") for _ in range(request.n)]

    async def load_weights(self, step: int, path: str) -> str | None:
        self.log.append(("load_weights", self.base_url, step, path))
        self.step = step
        return f"canned weights {step}"

    async def close(self) -> None:
        self.log.append(("close", self.base_url))


class RecordingRouter:
    """Round robin that records every pick and every outcome."""

    def __init__(self, urls, log):
        self.urls, self.log, self.next = list(urls), log, 0

    def pick(self, request, exclude=()):
        url = next(u for u in self.urls[self.next % len(self.urls):] + self.urls if u not in exclude)
        self.next += 1
        self.log.append(("pick", url, request))
        return url

    def done(self, url, *, ok, latency):
        self.log.append(("done", url, ok, latency))


class CountEnv:
    def tasks(self, rng: random.Random, n: int) -> list[Task]:
        return [Task(prompt=[{"role": "user", "content": f"count {rng.randint(0, 9)}"}]) for _ in range(n)]

    def score(self, task: Task, completion: str) -> float:
        return float(completion == "ab")


@pytest.fixture
def canned(register_plugin, tmp_path):
    """A tokenizer folder, the ``canned`` backend, a ``recording`` router and a ``count`` env."""
    from prime_plugin_hf.tiny import build_tokenizer

    build_tokenizer().save_pretrained(tmp_path / "tok")
    log: list = []

    class Plugin:
        fail = False

        @hookimpl
        def prime_inference_backends(self):
            def client(base_url, *, api_key, timeout):
                return CannedClient(base_url, api_key=api_key, timeout=timeout, log=log, fail=Plugin.fail)
            return [InferenceBackend(name="canned", server=print, client=client, priority=3)]

        @hookimpl
        def prime_routers(self):
            return [Router(name="recording", make=lambda urls: RecordingRouter(urls, log))]

        @hookimpl
        def prime_environments(self):
            return [Environment(name="count", load=CountEnv)]

    register_plugin(Plugin(), name="canned")
    return Plugin, log


def config(tmp_path, **overrides) -> OrchestratorConfig:
    data = {"model": {"name": str(tmp_path / "tok")}, "output_dir": str(tmp_path / "out"),
            "client": {"base_url": URLS, "router": "recording", "timeout": 17},
            "env": [{"id": "count"}], "batch_size": 4, "rollouts_per_example": 2, "max_steps": 2, "seq_len": 64,
            "sampling": {"temperature": 0.7, "top_p": 0.9}, **overrides}
    return OrchestratorConfig.model_validate(data)


def publish(out, step: int):
    folder = out / "weights" / f"step_{step}"
    folder.mkdir(parents=True)
    (folder / "STABLE").touch()
    return folder


def test_orchestrator_samples_only_through_the_client_and_router(canned, tmp_path, monkeypatch, capsys):
    from prime_core.orchestrator.role import Orchestrator

    _, log = canned
    monkeypatch.setenv("OPENAI_API_KEY", "secret")
    cfg = config(tmp_path)
    published = publish(cfg.output_dir, 1)
    orchestrator = Orchestrator(cfg)
    assert "inference backend: canned (auto" in capsys.readouterr().out, "the run says which backend auto picked"
    clients = list(orchestrator.clients.values())
    assert all(isinstance(c, InferenceClient) for c in clients)
    assert [(c.base_url, c.api_key, c.timeout) for c in clients] == [(u, "secret", 17.0) for u in URLS]
    orchestrator.wait_healthy()
    asyncio.run(orchestrator.run(start=1))

    # Weights reached every replica, then the probe ran (on the replica the router picked).
    loads = [e for e in log if e[0] == "load_weights"]
    assert sorted(loads) == sorted(("load_weights", u, 1, str(published)) for u in URLS)
    assert "loaded policy v1 into 2 inference server(s) as canned weights 1" in capsys.readouterr().out
    samples = [e for e in log if e[0] == "sample"]
    probe = samples[0]
    assert probe[1] == URLS[0] and probe[2].temperature == 0.0 and probe[2].max_tokens == 8

    # Every group's request (its rollouts' first turns as one, n = 2): picked by the router, on
    # the replica it picked, with an outcome.
    picks, dones = [e for e in log if e[0] == "pick"], [e for e in log if e[0] == "done"]
    assert picks[0][2] is probe[2]
    picks = picks[1:]
    assert len(picks) == len(dones) - 1 == 4, "2 steps x 2 groups, after the probe"
    assert {url for _, url, _ in picks} == set(URLS)
    assert all(ok and latency >= 0 for _, _, ok, latency in dones)
    for _, url, request in picks:
        assert ("sample", url, request) in samples
        assert (request.n, request.temperature, request.top_p) == (2, 0.7, 0.9)
        assert request.max_tokens == 64 - len(request.prompt_ids)
    assert len({request.session_id for _, _, request in picks}) == 4, "a session per group"
    assert sorted(e[1] for e in log if e[0] == "close") == sorted(URLS)

    # The batches hold the sampled tokens and logprobs exactly.
    for step in (1, 2):
        assert batch_file(cfg.output_dir, step).name == "batch.safetensors", "binary by default"
        batch = read_batch(batch_file(cfg.output_dir, step))
        assert batch["info"]["versions"] == [1]
    metrics = [json.loads(line) for line in (cfg.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["weights_version"] for m in metrics] == [1, 1] and metrics[0]["reward"] == 1.0
    assert metrics[0]["probe_logprob"] == pytest.approx(-0.5 - 0.25 - 0.25)


def test_a_run_from_scratch_serves_the_base_model_first_and_a_resumed_one_does_not(canned, tmp_path, capsys):
    """Servers the run did not start may serve an earlier run's policy: before its first sample,
    a run from scratch loads the base model's folder into every replica as policy v0."""
    from prime_core.orchestrator.role import Orchestrator

    _, log = canned
    cfg = config(tmp_path, max_steps=1)
    asyncio.run(Orchestrator(cfg).run(start=1))
    assert not [e for e in log if e[0] == "load_weights"], "no weights in the folder: nothing to load"
    assert "inference servers were not reset to the base model" in capsys.readouterr().out

    (tmp_path / "tok" / "model.safetensors").write_bytes(b"")  # the folder holds the base model's weights
    fresh = config(tmp_path, max_steps=1, output_dir=str(tmp_path / "fresh"))
    resumed = config(tmp_path, max_steps=2, output_dir=str(tmp_path / "resumed"))
    published = publish(resumed.output_dir, 1)
    for cfg, start, (step, path) in ((fresh, 1, (0, tmp_path / "tok")), (resumed, 2, (1, published))):
        log.clear()
        asyncio.run(Orchestrator(cfg).run(start=start))
        loads = [e[1:] for e in log if e[0] == "load_weights"]
        assert sorted(loads) == [(u, step, str(path)) for u in sorted(URLS)], "v0 from scratch; resumed: v1 only"
        first = next(i for i, e in enumerate(log) if e[0] == "sample")
        assert all(i < first for i, e in enumerate(log) if e[0] == "load_weights"), "loaded before any sample"
    assert "loaded the base model (policy v0) into 2 inference server(s)" in capsys.readouterr().out


def test_batch_format_json_writes_readable_batches_the_trainer_reads_alike(canned, tmp_path):
    from prime_core.orchestrator.role import Orchestrator

    with pytest.raises(ValueError, match=r"batch_format\n  Input should be 'binary' or 'json'"):
        config(tmp_path, batch_format="msgpack")
    cfg = config(tmp_path, batch_format="json", max_steps=1)
    publish(cfg.output_dir, 1)
    orchestrator = Orchestrator(cfg)
    orchestrator.probe = 0.0
    asyncio.run(orchestrator.run(start=1))
    path = batch_file(cfg.output_dir, 1)
    assert [p.name for p in path.parent.iterdir()] == ["batch.json"]
    text = json.loads(path.read_text())
    batch = read_batch(path)
    assert len(text["micro_batches"]) == len(batch["micro_batches"]) > 0
    for raw, row in zip(text["micro_batches"], batch["micro_batches"], strict=True):
        assert raw["input_ids"] == row["input_ids"].tolist() and raw["loss_mask"] == row["loss_mask"].tolist()


def test_a_failed_request_is_retried_on_another_replica_and_stops_the_run_when_all_fail(canned, tmp_path):
    from prime_core.orchestrator.role import Orchestrator

    plugin, log = canned
    orchestrator = Orchestrator(config(tmp_path))
    orchestrator.probe = 0.0
    orchestrator.clients[URLS[1]].fail = True  # healthy, but every request fails there
    asyncio.run(orchestrator.run(start=1))
    picks, dones = [e for e in log if e[0] == "pick"], [e for e in log if e[0] == "done"]
    assert len(picks) == len(dones) > 0, "every pick gets its done, also for failed requests"
    failed = [e for e in dones if not e[2]]
    assert failed and all(e[1] == URLS[1] for e in failed), "the router heard of each failure"
    assert sum(e[2] for e in dones) == 4, "each of the 4 groups' requests succeeded on the other replica"
    metrics = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert sum(m["request_retries"] for m in metrics) == len(failed)
    served = {url: sum(m[f"replica_requests/{url}"] for m in metrics) for url in ("replica-a:1", "replica-b:2")}
    assert served == {"replica-a:1": 4, "replica-b:2": 0}
    assert [m["replicas_up"] for m in metrics] == [2, 2], "a replica that answers its health check stays in"

    plugin.fail = True  # every replica fails every request: the run stops with the error
    log.clear()
    orchestrator = Orchestrator(config(tmp_path, output_dir=str(tmp_path / "out2"),
                                       client={"base_url": URLS, "router": "recording", "max_retries": 1}))
    with pytest.raises(PrimeError, match="sampling at http://replica-b:2/v1 failed"):
        asyncio.run(orchestrator.run(start=1))
    picks, dones = [e for e in log if e[0] == "pick"], [e for e in log if e[0] == "done"]
    assert [e[1] for e in picks] == [e[1] for e in dones] == URLS, "the probe's request, then its retry elsewhere"
    assert sorted(e[1] for e in log if e[0] == "close") == sorted(URLS)


def test_a_router_picking_an_unknown_replica_is_named(canned, tmp_path, register_plugin):
    from prime_core.orchestrator.role import Orchestrator

    class Elsewhere:
        @hookimpl
        def prime_routers(self):
            class Picker:
                def __init__(self, urls):
                    pass

                def pick(self, request, exclude=()):
                    return "http://nowhere/v1"

                def done(self, url, *, ok, latency):
                    pass
            return [Router(name="elsewhere", make=Picker)]

    register_plugin(Elsewhere(), name="elsewhere")
    orchestrator = Orchestrator(config(tmp_path, client={"base_url": URLS, "router": "elsewhere"}))
    orchestrator.probe = 0.0
    with pytest.raises(PrimeError, match="router = 'elsewhere' picked 'http://nowhere/v1', which is not in"):
        asyncio.run(orchestrator.run(start=1))


def test_round_robin_takes_outcomes_and_requests():
    from prime_core.routers import RoundRobin

    router = RoundRobin(URLS)
    request = SampleRequest(prompt_ids=[1], max_tokens=1, session_id="s")
    picked = [router.pick(request) for _ in range(3)]
    assert picked == [URLS[0], URLS[1], URLS[0]]
    router.done(URLS[0], ok=False, latency=1.5)


def test_auto_takes_the_available_backend_with_the_highest_priority(plugin_manager, register_plugin):
    from prime_core.inference.backend import select_backend

    with pytest.raises(PluginError, match="orchestrator.client.backend = 'auto': no installed inference backend"):
        select_backend("auto", key="orchestrator.client.backend")

    class Backends:
        @hookimpl
        def prime_inference_backends(self):
            return [InferenceBackend(name="low", server=print, client=print),
                    InferenceBackend(name="high", server=print, client=print, priority=5,
                                     available=lambda: "its engine is not installed"),
                    InferenceBackend(name="mid", server=print, client=print, priority=2)]

    register_plugin(Backends(), name="backends")
    assert select_backend("auto", key="k").name == "mid", "the highest priority that can run here"
    assert select_backend("low", key="k").name == "low"
    with pytest.raises(PluginError, match="k = 'high'.*its engine is not installed"):
        select_backend("high", key="k")


def test_config_validate_reports_auto_without_a_backend(plugin_manager, prime_cli):
    result = prime_cli("config", "validate")
    assert "inference.backend = 'auto': no installed inference backend can run here" in result.output


def test_requests_and_samples_check_themselves():
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        SampleRequest(prompt_ids=[], max_tokens=1)
    with pytest.raises(ValueError, match="n >= 1"):
        SampleRequest(prompt_ids=[1], max_tokens=1, n=0)
    with pytest.raises(ValueError, match="2 token ids but 1 logprobs"):
        Sample(token_ids=[1, 2], logprobs=[0.0], finish_reason="stop", text="")
