"""prime-plugin-fsdp: FSDP, HSDP and both CPU offloads match a single eager process over
several optimizer steps (gloo, 2 and 4 processes), and sharded checkpoints load at another
world size."""

import pytest

from prime_core import PLUGIN_API_VERSION
from prime_core.parity import TINY, compare, run
from prime_core.plugins import PluginManager

import prime_plugin_fsdp.plugin as plugin

TWO = [
    {"name": "fsdp", "model": {"impl": "hf"}},
    {"name": "no_reshard", "model": {"impl": "hf", "reshard_after_forward": False}},
    {"name": "fsdp_cpu_offload", "model": {"impl": "hf", "fsdp_cpu_offload": True}},
    {"name": "optim_cpu_offload", "model": {"impl": "hf", "optim_cpu_offload": True}},
    {"name": "ckpt", "model": {"impl": "hf"}, "steps": 4, "ckpt_step": 2},
]
FOUR = [{"name": "fsdp4", "model": {"impl": "hf"}}, {"name": "hsdp", "model": {"impl": "hf", "dp_replicate": 2}}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from prime_plugin_hf.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("m") / "tiny", **TINY)


@pytest.fixture(scope="module")
def results(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("parity")
    run(tiny, out, TWO + FOUR, reference=True)
    run(tiny, out, TWO, processes=2, save_ckpt=True)
    run(tiny, out, FOUR, processes=4)
    return out


def test_declares_the_plugin_api():
    assert plugin.PRIME_PLUGIN_API == PLUGIN_API_VERSION


def test_registers_the_fsdp_strategy():
    manager = PluginManager(autoload=True, disabled=()).load()
    spec = manager.select("parallel_strategies", "fsdp")
    assert spec.mesh_dims == ("dp_replicate", "dp_shard")


@pytest.mark.parametrize("case", TWO + FOUR, ids=lambda c: c["name"])
def test_matches_a_single_process(results, case):
    import torch

    worst = compare(results / f"{case['name']}.reference.pt", results / f"{case['name']}.pt")
    got = torch.load(results / f"{case['name']}.pt", weights_only=False)
    assert "fsdp" in got["applied"] and got["world_size"] in (2, 4)
    assert worst["weight"] < 2e-5


def test_checkpoint_from_two_processes_resumes_in_one_and_in_four(tiny, results, tmp_path):
    """Steps 1-2 on 2 ranks, saved; steps 3-4 after loading it on 1 rank and on 4 ranks."""
    import shutil

    case = [c for c in TWO if c["name"] == "ckpt"]
    for processes in (1, 4):
        out = tmp_path / str(processes)
        shutil.copytree(results / "ckpt", out / "ckpt")
        run(tiny, out, case, processes=processes, load_ckpt=True)
        import torch

        ref = torch.load(results / "ckpt.reference.pt", weights_only=False)
        got = torch.load(out / "ckpt.pt", weights_only=False)
        assert got["world_size"] == processes and len(got["losses"]) == 2
        for a, b in zip(ref["losses"][2:], got["losses"], strict=True):
            assert abs(a - b) < 1e-4 * abs(a) + 2e-5
        for key, value in ref["state"].items():
            assert torch.allclose(value, got["state"][key], rtol=1e-4, atol=2e-5), key
