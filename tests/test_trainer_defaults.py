"""Fast by default (``prime_core.trainer.defaults``): the keys a user leaves undecided are
decided by the plugins that own them when the trainer starts. On a GPU in bf16 the native
model gets torch's fused attention, the chunked LM head (RL) and compiled blocks; a value the
user wrote always wins; a CPU run, a float32 run and the transformers implementation keep the
reference paths; the trainer says what it picked in its first lines, and ``prime plan``
predicts the run as it will be decided."""

from __future__ import annotations

import pytest

from prime_core import PLUGIN_API_VERSION, hookimpl
from prime_core.testing import config_only_model


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return config_only_model(tmp_path_factory.mktemp("m") / "qwen3", model_type="qwen3", architectures=[
        "Qwen3ForCausalLM"], hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=320, max_position_embeddings=256)


def _model(manager, folder, **keys):
    from prime_core.config.checks import section_model

    return section_model("trainer", "model", manager)(name=str(folder), **keys)


def _decide(manager, folder, *, device="cuda", role="trainer", planning=True, processes=1, **keys):
    import torch

    from prime_core.distributed import World
    from prime_core.trainer.build import decide_defaults
    from prime_core.trainer.model import resolve_impl

    config = _model(manager, folder, **keys)
    world = World(size=processes, device=torch.device(device))
    config, choices = decide_defaults(config, manager, world, resolve_impl(config, manager).name, role,
                                      planning=planning)
    return config, {c.key: c for c in choices}


def test_a_gpu_run_in_bf16_gets_the_fast_paths(installed_plugins, qwen3):
    config, choices = _decide(installed_plugins, qwen3)
    assert set(choices) == {"impl", "attn", "fused_lm_head_token_chunk_size", "compile"}
    assert config.impl == "custom" and config.attn == "torch_fused"
    assert config.fused_lm_head_token_chunk_size == "auto"
    assert type(config.compile).__name__ == "CompileConfig"
    assert choices["attn"].plugin == "flash_attn" and choices["compile"].reason


def test_the_kernel_is_chosen_only_where_torch_has_it(installed_plugins, qwen3):
    """A trainer decides on its own device: here (no GPU) torch's fused kernels are missing, so
    the model keeps its default kernel; ``prime plan`` assumes a GPU that has them."""
    config, choices = _decide(installed_plugins, qwen3, planning=False)
    assert "attn" not in choices and config.attn == "auto"
    assert "compile" in choices  # the rest does not depend on a probe


@pytest.mark.parametrize("keys, kept", [
    ({"attn": "sdpa"}, {"attn": "sdpa"}),
    ({"compile": False}, {"compile": None}),
    ({"fused_lm_head_token_chunk_size": "disabled"}, {"fused_lm_head_token_chunk_size": "disabled"}),
    ({"fused_lm_head_token_chunk_size": 4096}, {"fused_lm_head_token_chunk_size": 4096}),
    ({"impl": "custom"}, {"impl": "custom"}),
], ids=["attn", "compile", "lm_head_off", "lm_head_chunk", "impl"])
def test_what_the_user_wrote_wins(installed_plugins, qwen3, keys, kept):
    config, choices = _decide(installed_plugins, qwen3, **keys)
    for key, value in kept.items():
        assert getattr(config, key) == value and key not in choices


@pytest.mark.parametrize("case", ["cpu", "float32", "hf"])
def test_no_fast_path_where_it_does_not_apply(installed_plugins, qwen3, case):
    keys = {"cpu": {"device": "cpu"}, "float32": {"dtype": "float32"}, "hf": {"impl": "hf"}}[case]
    config, choices = _decide(installed_plugins, qwen3, **keys)
    assert set(choices) <= {"impl"}
    assert config.attn == "auto" and config.compile == "auto" and config.fused_lm_head_token_chunk_size is None


def test_sft_keeps_the_vanilla_lm_head(installed_plugins, qwen3):
    _, choices = _decide(installed_plugins, qwen3, role="sft")
    assert "fused_lm_head_token_chunk_size" not in choices and "compile" in choices


@pytest.mark.parametrize("keys", [{"cp": 2}, {"lora": {}}], ids=["cp", "lora"])
def test_compile_stays_off_where_it_is_not_verified(installed_plugins, qwen3, keys):
    _, choices = _decide(installed_plugins, qwen3, processes=2, **keys)
    assert "compile" not in choices and "attn" in choices


def test_two_plugins_choosing_one_key_are_refused(installed_plugins, qwen3):
    from prime_core.errors import PluginError
    from prime_core.trainer.defaults import Choice

    class Greedy:
        PRIME_PLUGIN_API = PLUGIN_API_VERSION

        @hookimpl
        def prime_trainer_defaults(self, model_config, context):
            return [Choice("attn", "mine", "greedy")]

    installed_plugins.register(Greedy(), name="greedy")
    try:
        with pytest.raises(PluginError, match="'flash_attn' and 'greedy' both choose trainer.model.attn"):
            _decide(installed_plugins, qwen3)
    finally:
        installed_plugins.unregister("greedy")


def test_a_cpu_trainer_builds_as_before_and_says_what_it_decided(installed_plugins, tmp_path, capsys):
    """The CPU run keeps the reference paths: no compile, the vanilla LM head, the model's own
    attention kernel; its first line names the one decision (the implementation)."""
    import torch

    from prime_core.distributed import World, shutdown
    from prime_core.parity import TINY
    from prime_core.trainer.build import build_policy
    from prime_plugin_hf.tiny import build_tiny

    folder = build_tiny(tmp_path / "tiny", **TINY)
    try:
        policy = build_policy(_model(installed_plugins, folder, dtype="float32"), installed_plugins,
                              World(device=torch.device("cpu")))
    finally:
        shutdown()
    assert policy.applied == [] and policy.impl == "custom"
    assert policy.model.lm_head_fn is None
    assert policy.model.model.layers[0].self_attn.attention_fn.__name__ == "sdpa_attention"
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith("trainer defaults (cpu, 1 process(es); set a key in trainer.model to override): "
                           "impl = 'custom'")


def test_prime_plan_predicts_the_run_as_it_will_be_decided(prime_cli, installed_plugins, qwen3):
    result = prime_cli("plan", "--root", "trainer", "--model.name", str(qwen3), "--gpu-memory", "80")
    assert result.exit_code == 0, result.output
    assert "decided at start: attn = 'torch_fused'" in result.output
    # The LM head the GPU run will use; a tiny row's logits are small enough to keep for the backward.
    assert "fused (auto token chunks, logits kept for backward)" in result.output



@pytest.mark.parametrize("head_dim, attn", [(16, "torch_fused"), (32, "flash_attention_4")])
def test_the_plugins_decide_with_the_checkpoint_s_config(installed_plugins, tmp_path, monkeypatch, head_dim, attn):
    """The plugins see the checkpoint's config: with flash-attention 4 installed, ``prime plan``
    takes it only at a head dim it was checked at."""
    from prime_plugin_flash_attn import plugin

    monkeypatch.setattr(plugin, "_installed", lambda module: module == "flash_attn.cute")
    folder = config_only_model(tmp_path / "qwen3", model_type="qwen3", architectures=["Qwen3ForCausalLM"],
                               hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=head_dim, vocab_size=320, max_position_embeddings=256)
    config, _ = _decide(installed_plugins, folder)
    assert config.attn == attn
