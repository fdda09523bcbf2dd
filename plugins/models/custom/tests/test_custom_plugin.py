"""prime-plugin-custom registers the ``custom`` model implementation and the grouped_mm
kernels; ``impl = "auto"`` picks it only for what it reproduces exactly."""

import subprocess
import sys
from types import SimpleNamespace

import pytest

import prime_plugin_custom.plugin as plugin
from prime_core import PLUGIN_API_VERSION
from prime_core.errors import ConfigError
from prime_core.plugins import PluginManager
from prime_core.trainer.model import resolve_impl


def test_declares_the_plugin_api():
    assert plugin.PRIME_PLUGIN_API == PLUGIN_API_VERSION


def test_importing_the_hooks_does_not_import_torch():
    code = "import sys, prime_plugin_custom.plugin; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_registers_the_model_implementation_and_kernels():
    manager = PluginManager(autoload=True, disabled=()).load()
    record = manager.records["custom"]
    assert (record.status, record.dist) == ("active", "prime-plugin-custom")
    provided = manager.provided_by(record)
    (impl,) = provided["prime_model_impls"]
    assert (impl.name, impl.priority, impl.state_dict_adapter is not None) == ("custom", 10, True)
    kernels = {spec.key: spec for spec in provided["prime_kernels"]}
    assert set(kernels) == {"grouped_mm:torch", "grouped_mm:loop"}
    assert kernels["grouped_mm:loop"].unavailable_reason() is None
    import torch

    if not torch.cuda.is_available():
        assert "CUDA" in kernels["grouped_mm:torch"].unavailable_reason()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from transformers import GPT2Config, Qwen3Config

    from prime_plugin_custom.tiny import save_tiny

    root = tmp_path_factory.mktemp("configs")
    gpt2 = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, architectures=["GPT2LMHeadModel"])
    gpt2.save_pretrained(root / "gpt2")
    Qwen3Config(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                use_sliding_window=True, sliding_window=8, max_window_layers=0,
                architectures=["Qwen3ForCausalLM"]).save_pretrained(root / "sliding")
    save_tiny(root / "qwen3_moe", "Qwen3MoeForCausalLM")
    return root


def model_config(folder, impl):
    return SimpleNamespace(name=str(folder), impl=impl, trust_remote_code=False, dtype="float32", attn="sdpa")


def test_auto_picks_custom_for_a_supported_checkpoint_and_hf_otherwise(folders):
    manager = PluginManager(autoload=True, disabled=()).load()
    assert resolve_impl(model_config(folders / "qwen3_moe", "auto"), manager).name == "custom"
    assert resolve_impl(model_config(folders / "gpt2", "auto"), manager).name == "hf"
    assert resolve_impl(model_config(folders / "sliding", "auto"), manager).name == "hf", \
        "a supported architecture with a feature custom lacks goes to hf"


def test_explicit_custom_on_an_unsupported_architecture_names_the_fix(folders):
    from prime_plugin_custom.build import build

    with pytest.raises(ConfigError) as info:
        build(model_config(folders / "gpt2", "custom"))
    message = str(info.value)
    assert "GPT2LMHeadModel" in message and "Qwen3MoeForCausalLM" in message and "impl = 'hf'" in message
    with pytest.raises(ConfigError, match="sliding-window attention"):
        build(model_config(folders / "sliding", "custom"), device="meta")


def test_an_unknown_attention_kernel_is_refused_by_name(folders):
    from prime_core.errors import PluginError
    from prime_core.plugins import set_plugin_manager
    from prime_plugin_custom.build import build

    set_plugin_manager(PluginManager(autoload=True, disabled=()).load())
    try:
        with pytest.raises(PluginError, match="attention:no_such_kernel"):
            build(SimpleNamespace(**{**vars(model_config(folders / "qwen3_moe", "custom")), "attn": "no_such_kernel"}))
    finally:
        set_plugin_manager(None)


def test_rope_types_it_cannot_reproduce_are_refused():
    from prime_plugin_custom.families import unsupported_reason
    from prime_plugin_custom.tiny import tiny_config

    yarn = tiny_config("LlamaForCausalLM", rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                                             "factor": 4.0, "original_max_position_embeddings": 64})
    assert "rope type 'yarn'" in unsupported_reason(yarn)
    assert unsupported_reason(tiny_config("LlamaForCausalLM")) is None
