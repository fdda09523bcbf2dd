"""The attention kernels meet the kernel contract (prime_core.testing.contracts.kernel).
flash-attention 2, 3 and 4 run against the CPU stand-ins in ``fakes/`` where they cannot run
(checking the plugin's varlen plumbing, not flash-attention); torch's bundled kernels need a
CUDA GPU and skip with the reason elsewhere."""

import importlib
import sys
from pathlib import Path

import pytest

from prime_core.testing.contracts.kernel import KernelContract

FAKES = Path(__file__).parent / "fakes"
FLASH_MODULES = ("flash_attn", "flash_attn_interface")


def _forget_flash_modules():
    for name in [m for m in sys.modules if m.split(".")[0] in FLASH_MODULES]:
        del sys.modules[name]
    importlib.invalidate_caches()


class AttentionContract(KernelContract):
    plugin = "prime_plugin_flash_attn.plugin"
    dtypes = ("bfloat16", "float16")  # flash-attention computes in half precision only


class FlashContract(AttentionContract):
    ignore_available = True  # the real package where it runs, the stand-in elsewhere

    @pytest.fixture(autouse=True)
    def flash_or_stand_in(self, spec, monkeypatch):
        if spec.unavailable_reason() is None:
            yield
            return
        _forget_flash_modules()
        monkeypatch.syspath_prepend(str(FAKES))
        yield
        _forget_flash_modules()


class TestFlashAttention2(FlashContract):
    name = "attention:flash_attention_2"


class TestFlashAttention3(FlashContract):
    name = "attention:flash_attention_3"


class TestFlashAttention4(FlashContract):
    name = "attention:flash_attention_4"
    options = {"head_dim": 32}  # the smallest it takes (varlen.FA4_HEAD_DIMS)


class TestTorchFlash(AttentionContract):
    name = "attention:torch_flash"


class TestTorchFused(AttentionContract):
    name = "attention:torch_fused"
