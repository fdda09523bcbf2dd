"""The engine in this process, on tiny random models, against transformers' own forward pass:
log-probabilities at temperature and top-p, greedy samples, stop tokens, refused requests, and
weight updates while requests run (pausing, and draining as on transformers 5.17)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from prime_core.testing.contracts.inference_backend import changed_checkpoint, reference_logprobs

TOL = 2e-4


def engine_for(model: Path, out: Path, *tokens: str, use_pause: bool | None = None):
    from prime_core.cli.common import load_config
    from prime_plugin_transformers.engine import Engine

    config = load_config("inference", ["--model.name", str(model), "--backend", "transformers", "--output-dir",
                                       str(out), "--model.dtype", "float32", *tokens])
    engine = Engine(config, use_pause=use_pause)
    engine.load()
    return engine


def processed_logprobs(folder: Path, prompt: list[int], tokens: list[int], temperature: float, top_p: float):
    """Log-probabilities of ``tokens`` under the distribution they are sampled from: logits /
    temperature, then the smallest set of most likely tokens holding ``top_p`` of the mass,
    renormalised (vLLM's ``processed_logprobs``)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float() / temperature
    probs = logits.softmax(-1)
    ordered, order = probs.sort(-1, descending=True)
    keep_sorted = (ordered.cumsum(-1) - ordered) < top_p  # the mass of the more likely tokens is below top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    logp = logits.masked_fill(~keep, float("-inf")).log_softmax(-1)
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def close(a, b, tol=TOL) -> bool:
    return len(a) == len(b) and max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0) < tol


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from prime_plugin_hf.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny") / "model", hidden_size=64, num_layers=2, dtype="float32")


@pytest.fixture(scope="module")
def engine(model, tmp_path_factory):
    engine = engine_for(model, tmp_path_factory.mktemp("run"))
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def prompt(model) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)("What is 3+4? Answer:")["input_ids"]


def test_samples_carry_the_logprobs_of_the_distribution_they_were_drawn_from(engine, model, prompt):
    for temperature, top_p in ((1.0, 1.0), (0.7, 1.0), (1.3, 0.8)):
        samples = engine.sample({"prompt_ids": prompt, "n": 3, "max_tokens": 8, "temperature": temperature,
                                 "top_p": top_p})
        assert len(samples) == 3
        for s in samples:
            assert 1 <= len(s["token_ids"]) <= 8 and len(s["logprobs"]) == len(s["token_ids"])
            want = processed_logprobs(model, prompt, s["token_ids"], temperature, top_p)
            assert close(s["logprobs"], want), (temperature, top_p, s["logprobs"], want)
            assert isinstance(s["text"], str) and s["finish_reason"] in ("stop", "length")


def test_a_greedy_sample_is_the_argmax_with_unscaled_logprobs(engine, model, prompt):
    import torch
    from transformers import AutoModelForCausalLM

    (sample,) = engine.sample({"prompt_ids": prompt, "max_tokens": 8, "temperature": 0.0})
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for token in sample["token_ids"]:
            assert token == int(reference(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(token)
    assert close(sample["logprobs"], reference_logprobs(model, prompt, sample["token_ids"]))
    assert all(lp < 0 for lp in sample["logprobs"])  # not the 0 of the argmax-only distribution


def test_stop_tokens_end_a_sample_and_the_models_end_of_turn_always_does(engine, prompt):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(engine.config.model.name)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in engine.eos_token_ids
    (free,) = engine.sample({"prompt_ids": prompt, "max_tokens": 8, "temperature": 0.0})
    assert free["finish_reason"] == "length" and len(free["token_ids"]) == 8
    stop = free["token_ids"][3]
    first = free["token_ids"].index(stop)
    (stopped,) = engine.sample({"prompt_ids": prompt, "max_tokens": 8, "temperature": 0.0, "stop_token_ids": [stop]})
    assert stopped["token_ids"] == free["token_ids"][:first + 1] and stopped["finish_reason"] == "stop"


def test_text_skips_special_tokens_and_ids_beyond_the_tokenizer(engine):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(engine.config.model.name)
    ids = tokenizer("12")["input_ids"] + [tokenizer.convert_tokens_to_ids("<|im_end|>"), len(tokenizer)]
    assert engine.decode(ids) == "12"


@pytest.mark.parametrize("body, message", [
    ({"prompt_ids": [10**7], "max_tokens": 2}, "must be in [0, "),
    ({"prompt_ids": [], "max_tokens": 2}, "an empty prompt"),
    ({"prompt_ids": [5], "max_tokens": 5000}, "exceed the model's maximum length of 4096"),
    ({"prompt_ids": [5], "max_tokens": 2, "n": 0}, "need n >= 1"),
    ({"prompt_ids": [5], "max_tokens": 2, "top_p": 0}, "0 < top_p <= 1"),
    ({"prompt_ids": [5]}, "malformed sampling request"),
])
def test_bad_requests_are_refused_before_sampling(engine, body, message):
    from prime_plugin_transformers.params import BadRequest

    with pytest.raises(BadRequest, match=message.replace("[", r"\[").replace("+", r"\+")):
        engine.sample(body)


def test_a_folder_that_is_not_this_models_weights_changes_nothing(engine, model, prompt, tmp_path):
    from prime_core.testing.contracts.model_impl import tiny_checkpoint
    from prime_plugin_transformers.weights import WeightsError

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(WeightsError, match="is a LoRA adapter"):
        engine.load_weights(str(adapter), 1)
    with pytest.raises(WeightsError, match="not found"):
        engine.load_weights(str(tmp_path / "nowhere"), 1)
    with pytest.raises(WeightsError, match="tensors of other shapes|does not match"):
        engine.load_weights(str(tiny_checkpoint(tmp_path / "other")), 1)
    (sample,) = engine.sample({"prompt_ids": prompt, "max_tokens": 6, "temperature": 0.0})
    assert close(sample["logprobs"], reference_logprobs(model, prompt, sample["token_ids"]))


@pytest.mark.parametrize("use_pause", [True, False], ids=["pause", "drain"])
def test_weights_load_while_requests_run_and_serve_the_new_model(model, prompt, tmp_path, use_pause):
    engine = engine_for(model, tmp_path / "run", use_pause=use_pause)
    if use_pause and not hasattr(engine.manager, "pause"):
        engine.stop()
        pytest.skip("this transformers has no ContinuousBatchingManager.pause (before 5.19)")
    try:
        changed = changed_checkpoint(model, tmp_path / "step_1")
        results, errors = [], []

        def sample_long():
            try:
                results.extend(engine.sample({"prompt_ids": prompt, "n": 4, "max_tokens": 200, "temperature": 1.0}))
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=sample_long) for _ in range(3)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while len(engine._pending) < 12 and time.monotonic() < deadline:  # all 12 requests running
            time.sleep(0.01)
        report = engine.load_weights(str(changed), 1)
        for thread in threads:
            thread.join(120)
        assert not errors and len(results) == 12
        assert engine.version == 1 and report["how"] == "safetensors, staged, copied in place"
        if not use_pause:  # drained: the running requests finished on the old weights, every token of them
            assert report["waited"] > 0
            for s in results:
                assert close(s["logprobs"], reference_logprobs(model, prompt, s["token_ids"]))
        else:  # paused: the running requests went on with the new weights, as vLLM's do
            assert not all(close(s["logprobs"], reference_logprobs(model, prompt, s["token_ids"])) for s in results)
        (after,) = engine.sample({"prompt_ids": prompt, "max_tokens": 6, "temperature": 0.0})
        assert close(after["logprobs"], reference_logprobs(changed, prompt, after["token_ids"]))
        engine.load_weights(str(model), 2)
        (back,) = engine.sample({"prompt_ids": prompt, "max_tokens": 6, "temperature": 0.0})
        assert close(back["logprobs"], reference_logprobs(model, prompt, back["token_ids"]))
    finally:
        engine.stop()


def test_checkpoints_transformers_converts_are_loaded_converted(tmp_path):
    """A Qwen3-MoE checkpoint stores one tensor per expert; transformers' model fuses them."""
    from prime_plugin_hf.tiny import build_tiny

    model = build_tiny(tmp_path / "moe", hidden_size=64, num_layers=2, num_experts=4)
    engine = engine_for(model, tmp_path / "run")
    try:
        changed = changed_checkpoint(model, tmp_path / "step_1")
        assert engine.load_weights(str(changed), 1)["how"].startswith("converted by transformers")
        (sample,) = engine.sample({"prompt_ids": [5, 17, 42, 8], "max_tokens": 6, "temperature": 0.0})
        assert close(sample["logprobs"], reference_logprobs(changed, [5, 17, 42, 8], sample["token_ids"]))
    finally:
        engine.stop()


def test_a_stopped_engine_refuses_requests_and_reports_why(model, tmp_path):
    engine = engine_for(model, tmp_path / "run")
    assert engine.alive()
    engine.stop()
    engine.stop()
    assert not engine.alive() and engine.death() == "the engine is stopped"
    with pytest.raises(RuntimeError, match="stopped"):
        engine.sample({"prompt_ids": [5], "max_tokens": 2})
    with pytest.raises(RuntimeError, match="stopped"):
        engine.load_weights(str(model), 1)
