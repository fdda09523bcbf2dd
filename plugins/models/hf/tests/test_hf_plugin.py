"""prime-plugin-hf: the tiny model builder and the `hf` model implementation."""

import pytest

import prime_plugin_hf.plugin as plugin
from prime_core import PLUGIN_API_VERSION

pytest_plugins = ["prime_core.testing"]


def test_declares_the_plugin_api():
    assert plugin.PRIME_PLUGIN_API == PLUGIN_API_VERSION


def test_tiny_model_loads_like_any_checkpoint(register_plugin, prime_cli, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    register_plugin(plugin, name="hf")
    result = prime_cli("model", "tiny", str(tmp_path / "tiny"), "--hidden-size", "64", "--num-layers", "1")
    assert result.exit_code == 0, result.output
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tiny")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny")
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 1
    assert tokenizer.decode(tokenizer("abc xyz")["input_ids"]) == "abc xyz"
    assert len(tokenizer("abc")["input_ids"]) == 3, "one token per character"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert model.config.eos_token_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, model.config.vocab_size)


def test_head_dim_must_suit_vllm_cpu(tmp_path):
    from prime_plugin_hf.tiny import build_tiny

    with pytest.raises(ValueError, match="head_dim 24"):
        build_tiny(tmp_path / "m", head_dim=24)


def test_hf_impl_builds_the_configured_model(tmp_path):
    from prime_core.trainer.config import TrainerModelConfig
    from prime_plugin_hf.tiny import build_tiny

    build_tiny(tmp_path / "m", hidden_size=64, num_layers=1)
    (impl,) = plugin.prime_model_impls()
    model = impl.build(TrainerModelConfig(name=str(tmp_path / "m"), dtype="float32"))
    assert model.config.hidden_size == 64
    assert next(model.parameters()).dtype.is_floating_point


def test_hub_id_that_is_not_cached_is_a_clear_error(register_plugin, prime_cli, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    register_plugin(plugin, name="hf")
    result = prime_cli("trainer", "--model.name", "some-org/not-downloaded")
    assert result.exit_code == 1
    assert "model.name = 'some-org/not-downloaded': cannot load the model" in result.output
    assert "Traceback" not in result.output
