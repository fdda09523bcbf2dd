"""The fp8_linear kernels meet the kernel contract (prime_core.testing.contracts.kernel):
against float64 within FP8's error, and against their declared reference, the emulated
backend. deep_gemm and torch need a CUDA GPU and skip with the reason elsewhere."""

from prime_core.testing.contracts.kernel import KernelContract
from prime_core.testing.contracts.parallel_strategy import ParallelStrategyContract


class TestEmulated(KernelContract):
    name = "fp8_linear:emulated"
    plugin = "prime_plugin_fp8.plugin"
    dtypes = ("float32", "bfloat16")


class TestAuto(TestEmulated):
    name = "fp8_linear:auto"


class TestTorch(TestEmulated):
    name = "fp8_linear:torch"


class TestDeepGemm(TestEmulated):
    name = "fp8_linear:deep_gemm"
    dtypes = ("bfloat16",)


class TestStrategy(ParallelStrategyContract):
    """``quantization = "fp8"`` under FSDP on 2 processes matches one eager FP8 process (with the
    weight gradient in FP8 too: the bf16 one is a plain matmul)."""

    name = "fp8"
    resume = False  # the conversion keeps every Parameter: the fsdp suite checks resuming
    # SGD: Adam turns FP8 rounding flips of near-zero gradients into whole steps
    cases = [{"name": "custom_fp8", "model": {"impl": "custom", "quantization": "fp8", "fp8_wgrad": True},
              "optim": {"type": "sgd", "lr": 0.1}}]
