"""The custom model implementation meets the model-implementation contract
(prime_core.testing.contracts.model_impl) for a dense and a mixture-of-experts family, and its
grouped_mm kernels the kernel contract."""

import pytest

from prime_core.testing.contracts.kernel import KernelContract
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


class TestGroupedMmLoop(KernelContract):
    name = "grouped_mm:loop"
    plugin = "prime_plugin_custom.plugin"
    dtypes = ("float32", "bfloat16", "float64")


class TestGroupedMmTorch(KernelContract):
    name = "grouped_mm:torch"  # CUDA, bfloat16, sm90+: skips with the reason elsewhere
    plugin = "prime_plugin_custom.plugin"
    dtypes = ("bfloat16",)
