"""The hf model implementation meets the model-implementation contract
(prime_core.testing.contracts.model_impl) on a tiny Qwen3 and on ``prime model tiny``'s model."""

import pytest

from prime_core.testing.contracts.model_impl import ModelImplContract


class TestHf(ModelImplContract):
    name = "hf"
    plugin = "prime_plugin_hf.plugin"


class TestHfTinyMoE(ModelImplContract):
    name = "hf"
    plugin = "prime_plugin_hf.plugin"

    @pytest.fixture(scope="class")
    @classmethod
    def model_dir(cls, tmp_path_factory):
        from prime_plugin_hf.tiny import build_tiny

        return build_tiny(tmp_path_factory.mktemp("moe"), hidden_size=64, num_layers=2, num_experts=4)
