"""liger's kernels meet the kernel contract (prime_core.testing.contracts.kernel). Where
liger-kernel cannot run (no CUDA GPU, not installed), the CPU stand-in in ``fakes/`` takes its
place: the checks then cover the plugin's own code (argument order, layouts, copies, the LM
head's gradient path) against the eager references, not liger's Triton kernels."""

import importlib
import sys
from pathlib import Path
from typing import ClassVar

import pytest

from prime_core.testing.contracts.kernel import KernelContract

FAKES = Path(__file__).parent / "fakes"


def _forget_liger():
    for name in [m for m in sys.modules if m.split(".")[0] == "liger_kernel"]:
        del sys.modules[name]
    importlib.invalidate_caches()


class LigerContract(KernelContract):
    plugin = "prime_plugin_liger.plugin"
    dtypes = ("float32", "bfloat16")
    ignore_available = True  # the real liger where it runs, the stand-in elsewhere

    @pytest.fixture(autouse=True)
    def liger_or_stand_in(self, monkeypatch):
        from prime_plugin_liger.plugin import unavailable_reason

        if unavailable_reason() is None:
            yield
            return
        _forget_liger()
        monkeypatch.syspath_prepend(str(FAKES))
        yield
        _forget_liger()


class TestRmsnorm(LigerContract):
    name = "rmsnorm:liger"


class TestSwiglu(LigerContract):
    name = "swiglu:liger"


class TestRope(LigerContract):
    name = "rope:liger"


class TestLmHead(LigerContract):
    name = "lm_head:liger"
    options: ClassVar = {"rl": False}  # SFT only: no entropy, refused when asked for


class TestHfPatch(LigerContract):
    name = "hf_patch:liger"
