"""prime-plugin-ac: full and selective checkpointing and activation offloading change memory,
not numbers: 2 gloo processes with FSDP match a single eager process over several steps (the
parallel-strategy contract suite)."""

import pytest

import prime_plugin_ac.plugin as plugin
from prime_core import PLUGIN_API_VERSION
from prime_core.testing.contracts.parallel_strategy import ParallelStrategyContract

HF = {"impl": "hf"}


def test_declares_the_plugin_api():
    assert plugin.PRIME_PLUGIN_API == PLUGIN_API_VERSION


class TestCheckpointing(ParallelStrategyContract):
    name = "ac"
    resume = False  # wrappers change no parameter: the fsdp suite checks resuming
    cases = [
        {"name": "ac_full", "model": {**HF, "ac": {"freq": 1}}},
        {"name": "ac_every_other", "model": {**HF, "ac": {"freq": 2}}},
        {"name": "ac_selective",
         "model": {**HF, "ac": {"mode": "selective", "targets": ["norm", "attn_proj", "mlp_proj"]}}},
        {"name": "ac_offloading", "model": {**HF, "ac": {"freq": 1}, "ac_offloading": {"max_inflight_activations": 1}}},
    ]


class TestActivationOffloading(ParallelStrategyContract):
    name = "ac_offloading"
    resume = False
    cases = [{"name": "offloading_alone", "model": {**HF, "ac_offloading": {"max_inflight_activations": 5}}}]


def _model():
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    return Qwen3ForCausalLM(config)


def test_wrappers_sit_where_the_config_says():
    from prime_core.config.checks import section_model
    from prime_plugin_ac import checkpointing, offloading

    model = checkpointing.apply(_model(), config=section_model("trainer", "model")(ac={"freq": 2}))
    kinds = [type(b).__name__ for b in model.model.layers]
    assert kinds == ["CheckpointWrapper", "Qwen3DecoderLayer", "CheckpointWrapper"]

    config = section_model("trainer", "model")(ac={"mode": "selective", "targets": ["norm"]})
    model = checkpointing.apply(_model(), config=config)
    layer = model.model.layers[0]
    assert type(layer.input_layernorm).__name__ == "CheckpointWrapper"
    assert type(layer.self_attn.q_norm).__name__ == "CheckpointWrapper"
    assert type(layer.self_attn.q_proj).__name__ == "Linear"

    model = offloading.apply(_model(), config=section_model("trainer", "model")(ac_offloading={}))
    assert {type(b).__name__ for b in model.model.layers} == {"OffloadedBlock"}


def test_offloading_moves_saved_tensors_out_and_back():
    """The saved activations go through the offloader and gradients are unchanged."""
    import torch

    from prime_core.config.checks import section_model
    from prime_plugin_ac import offloading

    ids = torch.tensor([[1, 5, 7, 9, 3, 2]])
    plain = _model()
    plain(ids, labels=ids).loss.backward()
    config = section_model("trainer", "model")(ac_offloading={"max_inflight_activations": 1})
    model = offloading.apply(_model(), config=config)
    offloader = model.model.layers[0]._offloader
    packed = []
    pack = offloader.pack
    offloader.pack = lambda t: packed.append(pack(t)) or packed[-1]
    model(ids, labels=ids).loss.backward()
    assert sum(isinstance(p, offloading._Offloaded) for p in packed) > 10
    for (name, a), b in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name


def test_selective_targets_that_match_nothing_are_an_error():
    import torch

    from prime_plugin_ac.checkpointing import wrap_selected

    with pytest.raises(ValueError, match="nothing in Sequential matches"):
        wrap_selected(torch.nn.Sequential(torch.nn.ReLU()), ["attn_proj"])
