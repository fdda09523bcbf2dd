"""The fused LM heads meet the kernel contract (prime_core.testing.contracts.kernel).
lm_head:fused_triton runs where a CUDA GPU and Triton are, and skips with the reason elsewhere."""

from prime_core.testing.contracts.kernel import KernelContract
from prime_core.testing.contracts.parallel_strategy import ParallelStrategyContract


class TestFused(KernelContract):
    name = "lm_head:fused"
    plugin = "prime_plugin_fused_lm_head.plugin"
    dtypes = ("float32", "bfloat16", "float64")


class TestFusedTorch(TestFused):
    name = "lm_head:fused_torch"


class TestFusedTriton(TestFused):
    name = "lm_head:fused_triton"
    dtypes = ("float32", "bfloat16")


class TestStrategy(ParallelStrategyContract):
    """The chunked head under FSDP on 2 processes matches one eager process with the same head."""

    name = "fused_lm_head"
    resume = False  # it adds no parameter: the fsdp suite checks resuming
    cases = [{"name": "custom_fused_head", "model": {"impl": "custom", "fused_lm_head_token_chunk_size": 16}}]
