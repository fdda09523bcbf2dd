"""The custom model implementation meets the model-implementation contract
(prime_core.testing.contracts.model_impl) for a dense and a mixture-of-experts family."""

import pytest

from prime_core.testing.contracts.model_impl import ModelImplContract


class TestCustomQwen3(ModelImplContract):
    name = "custom"
    plugin = "prime_plugin_custom.plugin"


class TestCustomQwen2MoE(ModelImplContract):
    name = "custom"
    plugin = "prime_plugin_custom.plugin"

    @pytest.fixture(scope="class")
    @classmethod
    def model_dir(cls, tmp_path_factory):
        from prime_plugin_custom.tiny import save_tiny

        # Shared expert, raw top-k weights and dense layers between MoE layers.
        return save_tiny(tmp_path_factory.mktemp("qwen2-moe"), "Qwen2MoeForCausalLM", seed=1)
