"""``trainer.model.kernels = {hf_patch = NAME}`` rewrites the transformers model through the
``hf_patch:NAME`` kernel (liger's patching is one); other ops are refused for hf models."""

import pytest

from prime_core import hookimpl
from prime_core.plugins import PluginManager, set_plugin_manager
from prime_core.specs import Kernel


class Patcher:
    patched = []

    @hookimpl
    def prime_kernels(self):
        def mark(model):
            Patcher.patched.append(type(model).__name__)
            return model

        return [Kernel(op="hf_patch", name="probe", impl=mark)]


@pytest.fixture
def manager():
    manager = PluginManager(autoload=True, disabled=()).load()
    manager.register(Patcher(), name="patcher")
    set_plugin_manager(manager)
    yield manager
    set_plugin_manager(None)


def test_hf_patch_kernel_rewrites_the_model(tmp_path, manager):
    from prime_core.errors import ConfigError
    from prime_core.trainer.config import TrainerModelConfig
    from prime_plugin_hf.model import build
    from prime_plugin_hf.tiny import build_tiny

    folder = build_tiny(tmp_path / "tiny", hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=32)
    for device in ("cpu", "meta"):
        build(TrainerModelConfig(name=str(folder), impl="hf", kernels={"hf_patch": "probe"}), device=device)
    assert Patcher.patched == ["Qwen3ForCausalLM", "Qwen3ForCausalLM"]
    with pytest.raises(ConfigError, match="kernels.rmsnorm: this op is run by native models"):
        build(TrainerModelConfig(name=str(folder), impl="hf", kernels={"rmsnorm": "liger"}))
