"""The fused LM heads meet the kernel contract (prime_core.testing.contracts.kernel).
lm_head:fused_triton runs where a CUDA GPU and Triton are, and skips with the reason elsewhere."""

from prime_core.testing.contracts.kernel import KernelContract


class TestFused(KernelContract):
    name = "lm_head:fused"
    plugin = "prime_plugin_fused_lm_head.plugin"
    dtypes = ("float32", "bfloat16", "float64")


class TestFusedTorch(TestFused):
    name = "lm_head:fused_torch"


class TestFusedTriton(TestFused):
    name = "lm_head:fused_triton"
    dtypes = ("float32", "bfloat16")
