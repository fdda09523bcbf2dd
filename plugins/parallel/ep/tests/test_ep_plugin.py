"""prime-plugin-ep in one process: what it registers, the config checks of trainer.model.ep,
the errors of the strategy, and the torch backend's local path against the contract."""

from types import SimpleNamespace

import pytest

import prime_plugin_ep.plugin as plugin
from prime_core import PLUGIN_API_VERSION, hookimpl
from prime_core.plugins import PluginManager
from prime_core.specs import EPBackend
from prime_core.testing import config_only_model

pytest_plugins = ["prime_core.testing"]


def test_declares_the_plugin_api():
    assert plugin.PRIME_PLUGIN_API == PLUGIN_API_VERSION


def test_registers_the_strategy_and_the_torch_backend():
    manager = PluginManager(autoload=True, disabled=()).load()
    assert manager.records["ep"].status == "active"
    strategy = manager.select("parallel_strategies", "ep", key="trainer.model.ep")
    assert strategy.mesh_dims == ("dp_mod_ep", "ep")
    backend = manager.select("ep_backends", "torch", key="trainer.model.ep_comm_backend")
    assert backend.available is None


def test_importing_the_plugin_stays_cheap():
    import subprocess
    import sys

    code = "import sys, prime_plugin_ep.plugin; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


# ------------------------------------------------------------------ config checks


def _model_dir(tmp_path, name, **config):
    return str(config_only_model(tmp_path / name, **config))


def _trainer_model(**keys):
    from prime_core.config.checks import section_model

    return section_model("trainer", "model")(**keys)


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_refuses_an_ep_that_does_not_divide_the_experts(tmp_path, offline):
    moe = _model_dir(tmp_path, "moe", model_type="qwen3_moe", num_experts=6)
    rl = SimpleNamespace(trainer=SimpleNamespace(model=_trainer_model(name=moe, ep=4)))
    [problem] = plugin.prime_validate_config(config=rl, root="rl")
    assert problem.startswith("trainer.model.ep = 4 does not divide the 6 experts")
    assert "2, 3, 6" in problem
    sft = SimpleNamespace(model=_trainer_model(name=moe, ep=4))
    [problem] = plugin.prime_validate_config(config=sft, root="sft")
    assert problem.startswith("model.ep = 4 does not divide")
    ok = SimpleNamespace(trainer=SimpleNamespace(model=_trainer_model(name=moe, ep=3)))
    assert plugin.prime_validate_config(config=ok, root="rl") == []


def test_refuses_a_model_without_experts(tmp_path, offline):
    dense = _model_dir(tmp_path, "dense", model_type="qwen3")
    rl = SimpleNamespace(trainer=SimpleNamespace(model=_trainer_model(name=dense, ep=2)))
    [problem] = plugin.prime_validate_config(config=rl, root="rl")
    assert "trainer.model.ep = 2" in problem and "has no experts" in problem and "set trainer.model.ep = 1" in problem


def test_other_expert_keys_are_read(tmp_path, offline):
    mixtral = _model_dir(tmp_path, "mixtral", model_type="mixtral", num_local_experts=8)
    deepseek = _model_dir(tmp_path, "deepseek", model_type="deepseek_v3", n_routed_experts=12)
    assert plugin.prime_validate_config(config=SimpleNamespace(model=_trainer_model(name=mixtral, ep=4)),
                                        root="trainer") == []
    [problem] = plugin.prime_validate_config(config=SimpleNamespace(model=_trainer_model(name=deepseek, ep=8)),
                                             root="trainer")
    assert "12 experts" in problem


def test_an_unreachable_model_and_ep_1_are_not_checked(offline):
    unreachable = SimpleNamespace(trainer=SimpleNamespace(model=_trainer_model(name="nobody/no-such-model", ep=2)))
    assert plugin.prime_validate_config(config=unreachable, root="rl") == []
    dense = SimpleNamespace(trainer=SimpleNamespace(model=_trainer_model(name="nobody/no-such-model")))
    assert plugin.prime_validate_config(config=dense, root="rl") == []
    assert plugin.prime_validate_config(config=SimpleNamespace(), root="orchestrator") == []


def test_refuses_fsdp_cpu_offload_with_ep(offline):
    rl = SimpleNamespace(trainer=SimpleNamespace(model=_trainer_model(name="nobody/x", ep=2, fsdp_cpu_offload=True)))
    [problem] = plugin.prime_validate_config(config=rl, root="rl")
    assert problem.startswith("trainer.model.fsdp_cpu_offload: not supported with trainer.model.ep = 2")


def test_config_validate_reports_it(tmp_path, offline, register_plugin, prime_cli):
    register_plugin(plugin, name="ep")
    moe = _model_dir(tmp_path, "moe", model_type="qwen3_moe", num_experts=6)
    result = prime_cli("config", "validate", "--model.name", moe, "--trainer.model.ep", "4",
                       "--deployment.num_train_gpus", "4")
    assert result.exit_code == 2
    assert "trainer.model.ep = 4 does not divide the 6 experts" in result.output


# ------------------------------------------------------------------ strategy errors


class _Mesh:
    """Just enough of a DeviceMesh for the checks that come before any sharding."""

    def __init__(self, size):
        self._size = size

    def __getitem__(self, name):
        return self

    def size(self):
        return self._size


def _moe(num_experts):
    import torch
    from torch import nn

    experts = nn.Module()
    experts.gate_up_proj = nn.Parameter(torch.zeros(num_experts, 4, 2))
    layer = nn.Module()
    layer.num_experts, layer.experts, layer.dispatcher = num_experts, experts, None
    return nn.Sequential(nn.Linear(2, 2), layer)


def test_apply_refuses_experts_that_ep_does_not_divide():
    from prime_plugin_ep.strategy import apply

    with pytest.raises(ValueError, match="trainer.model.ep = 4 does not divide the 6 experts"):
        apply(_moe(6), mesh=_Mesh(4), config=_trainer_model(ep=4), world=SimpleNamespace(size=4))


def test_apply_refuses_a_model_without_moe_layers():
    from torch import nn

    from prime_plugin_ep.strategy import apply

    with pytest.raises(ValueError, match="has no MoE layers"):
        apply(nn.Linear(2, 2), mesh=_Mesh(2), config=_trainer_model(ep=2), world=SimpleNamespace(size=2))


# ------------------------------------------------------------------ the contract, locally


def test_torch_backend_alone_meets_the_contract():
    from prime_plugin_ep.contract import check_backend

    for dtype, limit in (("float32", 1e-6), ("bfloat16", 2e-2)):
        results = check_backend("torch", dtype=dtype)
        assert max(max(errors.values()) for errors in results.values()) < limit


def test_the_contract_catches_a_backend_that_forgets_the_weights(register_plugin):
    from prime_plugin_ep.contract import check_backend
    from prime_plugin_ep.dispatch import TorchDispatcher

    class Unweighted(TorchDispatcher):
        def combine(self, y_local, handle):
            handle.topk_weight = handle.topk_weight.detach() * 0 + 1
            return super().combine(y_local, handle)

    class Broken:
        PRIME_PLUGIN_API = PLUGIN_API_VERSION

        @hookimpl
        def prime_ep_backends(self):
            return [EPBackend(name="broken", make=lambda group, *, num_experts, config=None:
                              Unweighted(group, num_experts=num_experts))]

    register_plugin(Broken(), name="broken")
    with pytest.raises(AssertionError, match=r"uneven\.out = .*grad_topk_weight"):
        check_backend("broken", idle_rank=False)
