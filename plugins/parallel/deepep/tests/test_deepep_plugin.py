"""prime-plugin-deepep: availability reporting and its install hint, a clear failure when the
config selects it where it cannot run, the dispatcher's logic against a CPU stand-in for
deep_ep, and (on a GPU node with DeepEP) the EP contract itself."""

import importlib
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import prime_plugin_deepep.plugin as plugin
from prime_core import PLUGIN_API_VERSION
from prime_core.errors import PluginError
from prime_core.plugins import PluginManager
from prime_core.testing import config_only_model
from prime_core.testing.ranks import launch

pytest_plugins = ["prime_core.testing"]

HERE = Path(__file__).parent


def test_declares_the_plugin_api():
    assert plugin.PRIME_PLUGIN_API == PLUGIN_API_VERSION


def test_importing_the_plugin_stays_cheap():
    code = "import sys, prime_plugin_deepep.plugin; print('torch' in sys.modules, 'deep_ep' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False False"


# ------------------------------------------------------------------ availability


@pytest.fixture
def fake_install(tmp_path, monkeypatch):
    """Make ``deep_ep`` findable, with ``body`` as its ``__init__.py``."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)

    def install(body: str) -> None:
        (tmp_path / "deep_ep").mkdir(exist_ok=True)
        (tmp_path / "deep_ep" / "__init__.py").write_text(body)
        importlib.invalidate_caches()

    yield install
    sys.modules.pop("deep_ep", None)


def test_without_deep_ep_the_reason_carries_the_install_hint():
    reason = plugin.unavailable_reason()
    assert reason.startswith("deep_ep is not installed: ")
    assert "https://github.com/deepseek-ai/DeepEP" in reason


def test_with_deep_ep_but_no_gpu(fake_install, monkeypatch):
    import torch

    fake_install("")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert plugin.unavailable_reason().startswith("DeepEP needs CUDA GPUs")


def test_a_broken_deep_ep_build_is_reported(fake_install, monkeypatch):
    import torch

    fake_install("raise ImportError('libnvshmem_host.so.3: cannot open shared object file')")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    reason = plugin.unavailable_reason()
    assert reason.startswith("deep_ep is installed but does not import (ImportError: libnvshmem")
    assert "https://github.com/deepseek-ai/DeepEP" in reason


def test_available_with_deep_ep_and_a_gpu(fake_install, monkeypatch):
    import torch

    fake_install("")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert plugin.unavailable_reason() is None


def test_plugins_list_shows_it_unavailable_with_the_reason(prime_cli):
    from prime_core.plugins import set_plugin_manager

    set_plugin_manager(PluginManager(autoload=True, disabled=()))
    try:
        result = prime_cli("plugins", "list", "--json")
    finally:
        set_plugin_manager(None)
    assert result.exit_code == 0, result.output
    [row] = [p for p in json.loads(result.output)["plugins"] if p["name"] == "deepep"]
    assert row["status"] == "unavailable" and row["reason"] == plugin.unavailable_reason()
    assert row["provides"]["ep_backends"] == [{"name": "deepep", "unavailable": plugin.unavailable_reason()}]
    assert row["provides"]["config_sections"] == [
        {"name": "trainer.model.deepep_num_sms, trainer.model.deepep_token_chunk_size", "unavailable": None}]


# ------------------------------------------------------------------ selecting it


@pytest.fixture
def with_ep(register_plugin):
    import prime_plugin_ep.plugin as ep

    register_plugin(ep, name="ep")
    register_plugin(plugin, name="deepep")


def test_selecting_it_fails_with_the_reason(with_ep, plugin_manager):
    with pytest.raises(PluginError, match="trainer.model.ep_comm_backend = 'deepep'.*cannot run here: deep_ep is not"):
        plugin_manager.select("ep_backends", "deepep", key="trainer.model.ep_comm_backend")


def test_config_validate_refuses_it(with_ep, prime_cli, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config_only_model(tmp_path, model_type="qwen3_moe", num_experts=8)
    args = ["config", "validate", "--model.name", str(tmp_path), "--trainer.model.ep", "2",
            "--deployment.num_train_gpus", "2"]
    result = prime_cli(*args, "--trainer.model.ep_comm_backend", "deepep")
    assert result.exit_code == 2
    assert "trainer.model.ep_comm_backend = 'deepep'" in result.output
    assert "deep_ep is not installed" in result.output
    assert "ep_comm_backend" not in prime_cli(*args).output  # the torch default is fine


def test_the_ep_strategy_fails_with_the_reason(with_ep):
    import torch
    from torch import nn

    from prime_core.config.checks import section_model
    from prime_plugin_ep.strategy import apply

    class Mesh:
        def __getitem__(self, name):
            return self

        def size(self):
            return 2

    layer = nn.Module()
    layer.experts = nn.Module()
    layer.experts.down_proj = nn.Parameter(torch.zeros(4, 2, 2))
    layer.num_experts, layer.dispatcher = 4, None
    config = section_model("trainer", "model")(ep=2, ep_comm_backend="deepep")
    with pytest.raises(PluginError, match="cannot run here: deep_ep is not installed"):
        apply(layer, mesh=Mesh(), config=config, world=SimpleNamespace(size=2))


def test_refuses_an_odd_number_of_sms():
    from prime_core.config.checks import section_model

    config = SimpleNamespace(trainer=SimpleNamespace(model=section_model("trainer", "model")(
        ep=2, ep_comm_backend="deepep", deepep_num_sms=23)))
    [problem] = plugin.prime_validate_config(config=config, root="rl")
    assert problem.startswith("trainer.model.deepep_num_sms = 23: DeepEP needs an even number of SMs")
    config.trainer.model.deepep_num_sms = 24
    assert not plugin.prime_validate_config(config=config, root="rl")


# ------------------------------------------------------------------ the dispatcher


@pytest.mark.parametrize("processes", [2, 4])
def test_dispatcher_meets_the_contract_over_a_stand_in_deep_ep(tmp_path, processes):
    """fake_deep_ep.py reproduces DeepEP's documented Buffer semantics on gloo: this checks the
    dispatcher's own logic (expansion, grouping, weighting, chunks, padded empty inputs), not
    DeepEP's kernels."""
    from prime_plugin_ep.contract import TOLERANCE

    out = tmp_path / "fake.json"
    done = launch(processes, str(HERE / "deepep_fake_worker.py"), [str(out)], timeout=300, cwd=HERE)
    assert done.returncode == 0 and out.exists(), done.stdout[-3000:] + done.stderr[-6000:]
    ranks = json.loads(out.read_text())
    assert len(ranks) == processes and not any(r["failures"] for r in ranks)
    for rank in ranks:
        calls = rank["results"].pop("calls")
        assert calls["buffers"] == 2 and calls["dispatch"] == calls["combine"] > 4  # chunked runs send more
        worst = max(v for mode in rank["results"].values() for errors in mode.values() for v in errors.values())
        assert worst < TOLERANCE["bfloat16"]


def _gpus_for_deepep() -> str | None:
    reason = plugin.unavailable_reason()
    if reason:
        return reason
    import torch

    return None if torch.cuda.device_count() >= 2 else "needs at least 2 CUDA GPUs"


@pytest.mark.skipif(_gpus_for_deepep() is not None, reason=str(_gpus_for_deepep()))
def test_deepep_contract_on_gpus(tmp_path):
    import torch

    from prime_plugin_ep.contract import TOLERANCE, run_in_processes

    processes = 8 if torch.cuda.device_count() >= 8 else 2
    for rank in run_in_processes("deepep", processes, tmp_path, dtype="bfloat16", hidden=256):
        worst = max(v for errors in rank["world"].values() for v in errors.values())
        assert worst < TOLERANCE["bfloat16"]
