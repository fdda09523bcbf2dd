"""prime-plugin-fused-lm-head loads through its entry point and registers ``lm_head:fused``,
without importing torch until the kernel runs."""

import subprocess
import sys

import torch

import prime_plugin_fused_lm_head.plugin as plugin
from prime_core import PLUGIN_API_VERSION
from prime_core.plugins import PluginManager
from prime_core.specs import Kernel
from prime_plugin_fused_lm_head.reference import reference_logprobs


def test_declares_the_plugin_api():
    assert plugin.PRIME_PLUGIN_API == PLUGIN_API_VERSION


def test_registers_lm_head_fused_and_it_runs():
    manager = PluginManager(autoload=True, disabled=()).load()
    record = manager.records["fused_lm_head"]
    assert (record.status, record.dist) == ("active", "prime-plugin-fused-lm-head")
    assert [s.key for s in manager.provided_by(record)["prime_kernels"]] == [
        "lm_head:fused", "lm_head:fused_torch", "lm_head:fused_triton"]
    kernel = manager.select("kernels", "lm_head:fused")
    assert isinstance(kernel, Kernel) and kernel.unavailable_reason() is None
    assert manager.registry("kernels")["lm_head:fused"].plugin == "fused_lm_head"
    assert "float64" in kernel.reference

    hidden, weight, targets = torch.randn(5, 8), torch.randn(13, 8), torch.randint(0, 13, (5,))
    logp, entropy = kernel.impl(hidden, weight, targets, 0.9, token_chunk=2, vocab_chunk=4)
    expected_logp, expected_entropy = reference_logprobs(hidden, weight, targets, 0.9)
    torch.testing.assert_close(logp.double(), expected_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy.double(), expected_entropy, rtol=1e-5, atol=1e-5)


def test_importing_the_plugin_does_not_import_torch():
    code = ("import sys, prime_plugin_fused_lm_head.plugin as p; p.prime_kernels(); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
