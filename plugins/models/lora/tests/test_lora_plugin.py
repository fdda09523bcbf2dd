"""prime-plugin-lora: only adapters train; FSDP over 2 gloo processes matches one process;
the published adapter is in the PEFT layout vLLM reads."""

import pytest

import prime_plugin_lora.plugin as plugin
from prime_core import PLUGIN_API_VERSION
from prime_core.testing.contracts.parallel_strategy import ParallelStrategyContract

pytest_plugins = ["prime_core.testing"]


def _model():
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=16))


def test_declares_the_plugin_api():
    assert plugin.PRIME_PLUGIN_API == PLUGIN_API_VERSION


def test_only_adapters_train_and_they_start_as_the_base_model():
    import torch

    from prime_core.config.checks import section_model
    from prime_core.distributed import World
    from prime_plugin_lora.lora import apply

    ids = torch.tensor([[1, 4, 9, 16, 25, 36]])
    base = _model()
    before = base(ids).logits.detach()
    frozen = {k: v.clone() for k, v in base.state_dict().items()}
    applied = apply(_model(), config=section_model("trainer", "model")(name="m", lora={"rank": 4, "alpha": 8}))
    model, export = applied.model, applied.exporter
    assert torch.allclose(model(ids).logits, before)  # B = 0
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * 7 * 2  # 7 projections × 2 blocks × (A, B)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for _ in range(2):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    assert not torch.allclose(model(ids).logits, before)
    for name, value in model.state_dict().items():
        plain = name.replace(".base.", ".")
        if plain in frozen:
            assert torch.equal(value, frozen[plain]), name
    adapter = export(model, World())
    assert set(adapter.config) >= {"r", "lora_alpha", "target_modules"} and adapter.config["r"] == 4
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert adapter.tensors[key].shape == (4, 32)
    assert adapter.tensors[key.replace("lora_A", "lora_B")].shape == (32, 4)


def test_unknown_targets_and_modules_to_save_are_refused():
    from prime_core.config.checks import section_model
    from prime_plugin_lora.lora import apply

    with pytest.raises(ValueError, match="no linear layer"):
        apply(_model(), config=section_model("trainer", "model")(name="m", lora={"target_modules": ["qkv"]}))
    config = section_model("trainer", "model")(name="m", lora={"modules_to_save": ["lm_head"]})
    problems = plugin.prime_validate_config(config=type("T", (), {"model": config})(), root="trainer")
    assert problems and "modules_to_save" in problems[0]


class TestLoRA(ParallelStrategyContract):
    name = "lora"
    cases = [{"name": "lora", "model": {"impl": "hf", "lora": {"rank": 4, "alpha": 8}}},
             {"name": "lora_ac", "model": {"impl": "hf", "lora": {"rank": 8, "target_modules": ["q_proj", "v_proj"]},
                                           "ac": {"freq": 1}}}]

    def test_only_the_adapters_train_and_are_published(self, runs):
        import torch

        out, cases = runs
        for case in cases:
            got = torch.load(out / f"{case['name']}.pt", weights_only=False)
            assert got["applied"][0] == "lora" and "fsdp" in got["applied"]
            assert all(".lora_" in key for key in got["state"])
            assert any(".lora_B." in k and v.abs().max() > 0 for k, v in got["state"].items())  # it trained


def test_merged_adapter_gives_the_trained_models_outputs(tmp_path, prime_cli):
    import torch
    from transformers import AutoModelForCausalLM

    from prime_core.config.checks import section_model
    from prime_core.distributed import World
    from prime_plugin_lora.lora import apply

    _model().save_pretrained(tmp_path / "base")
    applied = apply(_model(), config=section_model("trainer", "model")(name="m", lora={"rank": 4, "alpha": 8}))
    model, export = applied.model, applied.exporter
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.2)
    export(model, World()).save(tmp_path / "adapter")
    result = prime_cli("lora", "merge", str(tmp_path / "base"), str(tmp_path / "adapter"), str(tmp_path / "merged"))
    assert result.exit_code == 0, result.output
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, model(ids).logits, atol=1e-5)
