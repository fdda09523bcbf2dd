"""prime-plugin-fsdp: FSDP, HSDP and both CPU offloads match a single eager process over
several optimizer steps (gloo, 2 and 4 processes), through the parallel-strategy contract
suite, and sharded checkpoints load at another world size."""

import shutil

import pytest

import prime_plugin_fsdp.plugin as plugin
from prime_core import PLUGIN_API_VERSION
from prime_core.parity import compare, run
from prime_core.testing.contracts.parallel_strategy import ParallelStrategyContract

pytest_plugins = ["prime_core.testing"]

HF = {"impl": "hf"}
FOUR = [{"name": "fsdp4", "model": HF}, {"name": "hsdp", "model": {**HF, "dp_replicate": 2}}]


def test_declares_the_plugin_api():
    assert plugin.PRIME_PLUGIN_API == PLUGIN_API_VERSION


class TestFSDP(ParallelStrategyContract):
    name = "fsdp"
    on_by_default = True  # bf16 compute under fp32 master weights: FSDP's mixed precision
    cases = [
        {"name": "fsdp", "model": HF},
        {"name": "no_reshard", "model": {**HF, "reshard_after_forward": False}},
        {"name": "fsdp_cpu_offload", "model": {**HF, "fsdp_cpu_offload": True}},
        {"name": "optim_cpu_offload", "model": {**HF, "optim_cpu_offload": True}},
    ]

    def test_off_for_one_process_in_its_master_dtype(self, spec, manager):
        from prime_core.distributed import World
        from prime_core.testing.contracts.parallel_strategy import check_enabled, model_config

        check_enabled(spec, model_config(manager, dtype="float32"), World(), False,
                      "for one float32 process (it would only copy every weight once more)")

    def test_on_for_one_process_of_bf16_weights_without_a_master(self, spec, manager):
        from prime_core.distributed import World
        from prime_core.testing.contracts.parallel_strategy import check_enabled, model_config

        check_enabled(spec, model_config(manager, dtype="bfloat16", optimization_dtype="bfloat16"), World(), True,
                      "for one bf16 process without a master: the fused update in place (one_process.PlainWeights)")

    def test_four_processes_and_hsdp(self, model_dir, tmp_path):
        import torch

        run(model_dir, tmp_path, FOUR, reference=True)
        run(model_dir, tmp_path, FOUR, processes=4)
        for case in FOUR:
            compare(tmp_path / f"{case['name']}.reference.pt", tmp_path / f"{case['name']}.pt")
            assert torch.load(tmp_path / f"{case['name']}.pt", weights_only=False)["world_size"] == 4

    def test_checkpoint_from_two_processes_resumes_in_four(self, runs, model_dir, tmp_path):
        import torch

        out, cases = runs
        case = cases[0]
        shutil.copytree(out / case["name"], tmp_path / case["name"])
        run(model_dir, tmp_path, [case], processes=4, load_ckpt=True)
        ref = torch.load(out / f"{case['name']}.reference.pt", weights_only=False)
        got = torch.load(tmp_path / f"{case['name']}.pt", weights_only=False)
        assert got["world_size"] == 4 and len(got["losses"]) == 2
        for a, b in zip(ref["losses"][2:], got["losses"], strict=True):
            assert abs(a - b) < 1e-4 * abs(a) + 2e-5
        for key, value in ref["state"].items():
            assert torch.allclose(value, got["state"][key], rtol=1e-4, atol=2e-5), key


@pytest.mark.parametrize("keys, message", [
    ({"fsdp_cpu_offload": True, "optim_cpu_offload": True}, "mutually exclusive"),
])
def test_its_keys_are_checked(installed_plugins, keys, message):
    from prime_core.cli.common import load_config
    from prime_core.errors import ConfigError

    args = [token for key, value in keys.items() for token in (f"--trainer.model.{key}", str(value).lower())]
    with pytest.raises(ConfigError, match=message):
        load_config("rl", args)


def test_nodes_per_fsdp_group_sets_dp_replicate(installed_plugins):
    from prime_core.cli.common import load_config
    from prime_core.errors import ConfigError

    base = ["--deployment.num-train-nodes", "4", "--deployment.gpus-per-node", "2"]
    assert load_config("rl", [*base, "--deployment.nodes-per-fsdp-group", "2"]).trainer.model.dp_replicate == 2
    with pytest.raises(ConfigError, match="nodes_per_fsdp_group = 3 does not divide"):
        load_config("rl", [*base, "--deployment.nodes-per-fsdp-group", "3"])
    with pytest.raises(ConfigError, match="dp_replicate = 4 but deployment.nodes_per_fsdp_group = 2"):
        load_config("rl", [*base, "--deployment.nodes-per-fsdp-group", "2", "--trainer.model.dp-replicate", "4"])
