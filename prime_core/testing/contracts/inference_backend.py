"""Contract suite for inference backends (``prime_core.specs.InferenceBackend``).

The ``inference`` role calls ``spec.server(config)`` (one replica's config) and drives it:
``start()``, ``wait_healthy(timeout)``, ``wait()``, ``stop()``. The orchestrator calls
``spec.client(base_url, api_key=..., timeout=...)`` per replica and, on its event loop,
``sample(SampleRequest) -> list[Sample]``, ``load_weights(step, path)`` and ``close()``;
``health()`` from its main thread. This suite does the same against a real server of the
backend, serving a tiny random model, with transformers as the reference::

    from prime_core.testing.contracts.inference_backend import InferenceBackendContract

    class TestMine(InferenceBackendContract):
        name = "mine"
        server_args = ["--model.dtype", "float32"]      # inference-config overrides

The server is started once per class (override the ``served`` fixture to share one the
plugin's own tests already run). It checks that the client's creation contacts nobody and
``health()`` answers a bool without raising for a dead URL; that ``sample`` returns ``n``
samples of at most ``max_tokens`` tokens, each with one log-probability per token, finish
reasons ``stop``/``length``, and text; that the log-probabilities are those of the model
(transformers, at the request's temperature) for greedy and warm sampling; that a stop token
ends a sample as its last token; that the optional ``prompt_logprobs`` (a teacher's scores)
are the model's; that ``load_weights`` of a changed checkpoint changes the
samples to the new model's and back; that errors are ``PrimeError`` naming the server; and
that ``stop()`` ends the server (idempotently) and its health turns false.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import ClassVar

import pytest

from prime_core.ports import free_ports
from prime_core.testing.contracts import Contract, expect
from prime_core.testing.contracts.model_impl import tiny_checkpoint

PROMPT = [5, 17, 42, 8, 23, 61, 4]


def reference_logprobs(folder: Path, prompt: list[int], tokens: list[int], temperature: float = 1.0) -> list[float]:
    """Transformers' log-probabilities of ``tokens`` after ``prompt`` (logits / temperature)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float() / max(temperature, 1e-6)
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def changed_checkpoint(src: Path, dst: Path, scale: float = 0.5) -> Path:
    """A copy of the Hugging Face folder ``src`` with every tensor moved by noise."""
    import torch
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(1)
    for file in src.glob("*.safetensors"):
        state = load_file(file)
        save_file({k: (v + scale * torch.randn(v.shape, generator=generator, dtype=v.dtype)).contiguous()
                   for k, v in state.items()}, dst / file.name, metadata={"format": "pt"})
    for file in src.iterdir():
        if file.suffix != ".safetensors" and file.is_file():
            shutil.copy(file, dst / file.name)
    return dst


def _run(coroutine_fn, *args):
    return asyncio.run(coroutine_fn(*args))


async def _sample_all(client, requests):
    try:
        return [await client.sample(request) for request in requests]
    finally:
        await client.close()


def check_health_of_a_dead_url(spec) -> None:
    port = free_ports(1)  # nothing listens on it
    client = spec.client(f"http://127.0.0.1:{port}/v1", api_key=None, timeout=5.0)
    try:
        answer = client.health()
        expect(answer is False, f"backend '{spec.name}': health() of a dead server returned {answer!r}, not False")
    finally:
        _run(client.close)


def check_samples(spec, url: str, model: Path, api_key: str | None = None) -> None:
    from prime_core.inference.client import Sample, SampleRequest

    client = spec.client(url, api_key=api_key, timeout=120.0)
    expect(client.health() is True, f"backend '{spec.name}': health() is not True for its running server at {url}")
    many, (greedy,), (warm,) = _run(_sample_all, client, [
        SampleRequest(prompt_ids=PROMPT, n=3, max_tokens=6, temperature=1.0, seed=0, session_id="s-1"),
        SampleRequest(prompt_ids=PROMPT, max_tokens=6, temperature=0.0),
        SampleRequest(prompt_ids=PROMPT, max_tokens=6, temperature=0.5, seed=3),
    ])
    expect(len(many) == 3, f"backend '{spec.name}': n=3 gave {len(many)} samples")
    for sample in [*many, greedy, warm]:
        expect(isinstance(sample, Sample), f"backend '{spec.name}': sample() returned {type(sample).__name__}s")
        expect(1 <= len(sample.token_ids) <= 6, f"backend '{spec.name}': {len(sample.token_ids)} tokens for "
                                                "max_tokens=6")
        expect(all(isinstance(t, int) for t in sample.token_ids) and all(lp <= 1e-6 for lp in sample.logprobs),
               f"backend '{spec.name}': token ids must be ints and log-probabilities <= 0")
        expect(sample.finish_reason in ("stop", "length"), f"backend '{spec.name}': finish_reason "
                                                           f"{sample.finish_reason!r}")
        expect(isinstance(sample.text, str), f"backend '{spec.name}': text is not a string")
    for sample, temperature in ((greedy, 1.0), (warm, 0.5)):
        want = reference_logprobs(model, PROMPT, sample.token_ids, temperature)
        worst = max(abs(a - b) for a, b in zip(sample.logprobs, want, strict=True))
        expect(worst < 2e-3, f"backend '{spec.name}': log-probabilities at temperature {temperature} differ from "
                             f"the model's by {worst:.2e} (the trainer's importance ratio needs them exact)")


def check_prompt_logprobs(spec, url: str, model: Path, api_key: str | None = None) -> None:
    """The optional ``prompt_logprobs``: each given token's log-probability after the ones before
    it, as the model computes it (a teacher scoring a student's tokens)."""
    from prime_core.inference.client import can_score

    client = spec.client(url, api_key=api_key, timeout=120.0)
    if not can_score(client):
        pytest.skip(f"backend '{spec.name}' has no prompt_logprobs (optional; a teacher's server needs it)")
    tokens = [*PROMPT, 11, 3, 29, 7]

    async def score():
        try:
            return await client.prompt_logprobs(tokens)
        finally:
            await client.close()

    got = _run(score)
    expect(len(got) == len(tokens) and got[0] == 0.0, f"backend '{spec.name}': prompt_logprobs gave {len(got)} "
                                                      f"values for {len(tokens)} tokens (the first must be 0.0)")
    want = reference_logprobs(model, tokens[:1], tokens[1:])
    worst = max(abs(a - b) for a, b in zip(got[1:], want, strict=True))
    expect(worst < 2e-3, f"backend '{spec.name}': prompt_logprobs differ from the model's by {worst:.2e}")


def check_stop_tokens(spec, url: str, api_key: str | None = None) -> None:
    from prime_core.inference.client import SampleRequest

    (free,), = _run(_sample_all, spec.client(url, api_key=api_key, timeout=120.0),
                    [SampleRequest(prompt_ids=PROMPT, max_tokens=6, temperature=0.0)])
    if len(free.token_ids) < 3:
        pytest.skip("the model ended its greedy sample before a third token")
    stop = free.token_ids[2]
    first = free.token_ids.index(stop)
    (stopped,), = _run(_sample_all, spec.client(url, api_key=api_key, timeout=120.0),
                       [SampleRequest(prompt_ids=PROMPT, max_tokens=6, temperature=0.0, stop_token_ids=[stop])])
    expect(stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[:first + 1],
           f"backend '{spec.name}': with stop token {stop} the sample was {stopped.token_ids} "
           f"({stopped.finish_reason}); it must end with the stop token, finish_reason 'stop'")


def check_load_weights(spec, url: str, model: Path, tmp: Path, api_key: str | None = None) -> None:
    from prime_core.inference.client import SampleRequest

    changed = changed_checkpoint(model, tmp / "step_1")
    greedy = SampleRequest(prompt_ids=PROMPT, max_tokens=6, temperature=0.0)

    async def go(client):
        try:
            await client.load_weights(1, str(changed))
            (after,) = await client.sample(greedy)
            await client.load_weights(2, str(model))
            (back,) = await client.sample(greedy)
            return after, back
        finally:
            await client.close()

    after, back = _run(go, spec.client(url, api_key=api_key, timeout=120.0))
    want = reference_logprobs(changed, PROMPT, after.token_ids)
    worst = max(abs(a - b) for a, b in zip(after.logprobs, want, strict=True))
    expect(worst < 2e-3, f"backend '{spec.name}': after load_weights the samples are not the new model's "
                         f"(log-probabilities off by {worst:.2e})")
    want = reference_logprobs(model, PROMPT, back.token_ids)
    worst = max(abs(a - b) for a, b in zip(back.logprobs, want, strict=True))
    expect(worst < 2e-3, f"backend '{spec.name}': loading the first weights again did not restore them")


def check_errors_name_the_server(spec, url: str, api_key: str | None = None) -> None:
    from prime_core.errors import PrimeError
    from prime_core.inference.client import SampleRequest

    with pytest.raises(PrimeError) as err:
        _run(_sample_all, spec.client(url, api_key=api_key, timeout=60.0),
             [SampleRequest(prompt_ids=[10**7], max_tokens=2)])  # a token id no vocabulary has
    expect(url.removesuffix("/v1") in str(err.value), f"backend '{spec.name}': the error {str(err.value)!r} "
                                                      f"does not name the server {url}")


class InferenceBackendContract(Contract):
    """Subclass with ``name`` set; ``server_args`` adds inference-config overrides."""

    registry = "inference_backends"
    server_args: ClassVar[list[str]] = []
    startup_timeout: ClassVar[float] = 600.0
    api_key: ClassVar[str | None] = None
    """The key the served server requires, if a ``served`` override starts it with one."""

    @pytest.fixture(scope="class")
    @classmethod
    def model_dir(cls, tmp_path_factory) -> Path:
        from prime_core.testing.chat import chat_tokenizer

        folder = tiny_checkpoint(tmp_path_factory.mktemp("model") / "tiny")
        chat_tokenizer().save_pretrained(folder)  # a server detokenizes; requests are token ids
        return folder

    @pytest.fixture(scope="class")
    @classmethod
    def served(cls, model_dir, tmp_path_factory):
        """``(base_url, model folder)`` of a running server of the backend, started the way the
        ``inference`` role starts it; stopped (twice: ``stop`` is idempotent) at the end."""
        from prime_core.cli.common import load_config
        from prime_core.plugins import PluginManager, set_plugin_manager
        from prime_core.testing.contracts import manager_for

        manager = manager_for(cls.plugin) if cls.plugin is not None else PluginManager(autoload=True).load()
        set_plugin_manager(manager)
        spec = manager.registry(cls.registry)[cls.name].spec
        config = load_config("inference", ["--model.name", str(model_dir), "--backend", cls.name,
                                           "--output-dir", str(tmp_path_factory.mktemp("run")),
                                           "--server.port", str(free_ports(1)), *cls.server_args])
        server = spec.server(config)
        server.start()
        try:
            server.wait_healthy(cls.startup_timeout)
            yield server.base_url, model_dir
        finally:
            server.stop()
            server.stop()
            set_plugin_manager(None)
        client = spec.client(server.base_url, api_key=None, timeout=5.0)
        try:
            expect(client.health() is False, f"backend '{cls.name}': health() is still True after stop()")
        finally:
            _run(client.close)

    def test_health_of_a_dead_server_is_false(self, spec):
        check_health_of_a_dead_url(spec)

    def test_samples_token_ids_with_the_models_logprobs(self, spec, served):
        check_samples(spec, *served, api_key=self.api_key)

    def test_a_stop_token_ends_a_sample(self, spec, served):
        check_stop_tokens(spec, served[0], api_key=self.api_key)

    def test_prompt_logprobs_are_the_models(self, spec, served):
        check_prompt_logprobs(spec, *served, api_key=self.api_key)

    def test_load_weights_serves_the_new_model(self, spec, served, tmp_path):
        check_load_weights(spec, served[0], served[1], tmp_path, api_key=self.api_key)

    def test_errors_name_the_server(self, spec, served):
        check_errors_name_the_server(spec, served[0], api_key=self.api_key)
