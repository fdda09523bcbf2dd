"""prime-plugin-fp8 loads through its entry point, registers the ``fp8_linear`` kernels with
honest availability, satisfies ``trainer.model.quantization = "fp8"``, and imports no torch."""

import subprocess
import sys

import pytest
import torch

from prime_core import PLUGIN_API_VERSION
from prime_core.config.checks import check, schema_for
from prime_core.errors import PluginError
from prime_core.plugins import PluginManager
from prime_core.specs import Kernel
from prime_plugin_fp8 import gemm, plugin

KEYS = ["fp8_linear:auto", "fp8_linear:deep_gemm", "fp8_linear:emulated", "fp8_linear:torch"]


@pytest.fixture(scope="module")
def manager():
    return PluginManager(autoload=True, disabled=()).load()


def test_declares_the_plugin_api():
    assert plugin.PRIME_PLUGIN_API == PLUGIN_API_VERSION


def test_registers_the_fp8_linear_kernels(manager):
    record = manager.records["fp8"]
    assert (record.status, record.dist) == ("active", "prime-plugin-fp8")
    assert sorted(s.key for s in manager.provided_by(record)["prime_kernels"]) == KEYS
    for key in KEYS:
        spec = manager.registry("kernels")[key].spec
        assert isinstance(spec, Kernel) and spec.description
        assert spec.reference == ("" if key.endswith("emulated") else "emulated")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the reasons given on a machine without a GPU")
def test_availability_reasons_without_a_gpu(manager):
    kernels = manager.registry("kernels")
    assert kernels["fp8_linear:emulated"].spec.unavailable_reason() is None
    assert kernels["fp8_linear:auto"].spec.unavailable_reason() is None  # the emulated reference, off CUDA
    assert "needs a CUDA GPU" in kernels["fp8_linear:torch"].spec.unavailable_reason()
    reason = kernels["fp8_linear:deep_gemm"].spec.unavailable_reason()
    assert "deep_gemm is not installed" in reason and "DeepGEMM" in reason
    with pytest.raises(PluginError, match="needs a CUDA GPU"):
        manager.select("kernels", "fp8_linear:torch")


def test_availability_reasons_for_gpus_without_fp8(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(gemm, "_capability_without_init", lambda: (8, 0))
    for name in ("auto", "torch"):
        assert "compute capability >= 8.9" in gemm.unavailable(name) and "is 8.0" in gemm.unavailable(name)
    monkeypatch.setattr(gemm, "_capability_without_init", lambda: (10, 0))
    assert gemm.unavailable("torch") is None and gemm.unavailable("auto") is None
    monkeypatch.setattr(gemm.importlib.util, "find_spec", lambda name: object())
    assert "SM90 (Hopper) only" in gemm.unavailable("deep_gemm")
    monkeypatch.setattr(gemm, "_capability_without_init", lambda: None)  # unknown: checked at first use
    assert gemm.unavailable("deep_gemm") is None


def test_kernel_impl_converts_a_model(manager):
    from prime_plugin_custom.model import CausalLM
    from prime_plugin_custom.tiny import tiny_config

    with torch.device("meta"):
        model = CausalLM(tiny_config("Qwen3ForCausalLM"))
    assert manager.select("kernels", "fp8_linear:emulated").impl(model) == 14
    assert "fp8=emulated" in repr(model.model.layers[0].self_attn.q_proj)


def test_the_strategy_computes_the_weight_gradient_as_configured(manager):
    from prime_plugin_custom.model import CausalLM
    from prime_plugin_custom.tiny import tiny_config
    from prime_plugin_fp8 import strategy

    for fp8_wgrad in (True, False):
        keys = schema_for("trainer", manager).model_validate(
            {"model": {"quantization": "fp8", "fp8_wgrad": fp8_wgrad, "fp8_weight_cache": False,
                       "kernels": {"fp8_linear": "emulated"}}}).model
        with torch.device("meta"):
            model = strategy.apply(CausalLM(tiny_config("Qwen3ForCausalLM")), config=keys)
        assert model.model.layers[0].mlp.down_proj.fp8_wgrad is fp8_wgrad
        assert repr(model.model.layers[0].mlp.down_proj).endswith("" if fp8_wgrad else ", wgrad=high)")


@pytest.mark.parametrize(("processes", "key", "cached"), [(1, True, True), (1, False, False), (2, True, False)])
def test_the_strategy_keeps_weight_blocks_in_one_process_and_hands_the_trainer_the_hooks(manager, processes, key,
                                                                                         cached):
    from prime_core.distributed import World
    from prime_core.specs import Applied
    from prime_plugin_custom.model import CausalLM
    from prime_plugin_custom.tiny import tiny_config
    from prime_plugin_fp8 import strategy
    from prime_plugin_fp8.weight_cache import CACHE

    keys = schema_for("trainer", manager).model_validate(
        {"model": {"quantization": "fp8", "fp8_weight_cache": key, "kernels": {"fp8_linear": "emulated"}}}).model
    with torch.device("meta"):
        model = CausalLM(tiny_config("Qwen3ForCausalLM"))
    result = strategy.apply(model, config=keys, world=World(size=processes))
    linears = [m for m in model.modules() if hasattr(m, "cache_weight")]
    assert len(linears) == 14 and {m.cache_weight for m in linears} == {cached}
    if cached:
        assert isinstance(result, Applied) and result.model is model
        assert (result.before_backward, result.before_step) == (CACHE.before_backward, CACHE.before_step)
        assert "weight cached" in repr(linears[0])
    else:
        assert result is model


def test_satisfies_the_quantization_setting(manager, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # the default hub model may be downloaded: not this test's concern
    config = schema_for("trainer", manager).model_validate({"model": {"quantization": "fp8"}})
    assert check(config, "trainer", manager) == []


def test_importing_the_plugin_does_not_import_torch():
    code = ("import sys, prime_plugin_fp8.plugin as p; p.prime_kernels(); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
