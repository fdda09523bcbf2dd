"""The torchrun launcher: plans for one node and for this node of several (the seeds'
multi-node deployment blocks), and a real two-"node" SFT run on localhost (gloo) that gives
the losses of one node with the same world size."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import prime_plugin_torchrun.plugin as plugin
from prime_core import PLUGIN_API_VERSION
from prime_core.plugins import PluginManager

pytest_plugins = ["prime_core.testing"]
ROOT = Path(__file__).resolve().parents[4]


def test_declares_the_plugin_api():
    assert plugin.PRIME_PLUGIN_API == PLUGIN_API_VERSION


def test_registered_through_its_entry_point():
    manager = PluginManager(autoload=True, disabled=()).load()
    assert manager.records["torchrun"].status == "active"
    assert "torchrun" in manager.registry("launchers")
    assert "torchrun" in manager.registry("config_sections")


@pytest.fixture
def torchrun_cli(prime_cli, installed_plugins, monkeypatch):
    for name in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME",
                 "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)

    def invoke(root, out, *args, env=None, ok=True):
        result = prime_cli(root, "--output-dir", str(out), *args, "--dry-run", env=env)
        if ok:
            assert result.exit_code == 0, result.output
        return result

    return invoke


def plan_of(out: Path, node: int = 0) -> dict:
    return json.loads((out / "configs" / ("plan.json" if not node else f"plan.node_{node}.json")).read_text())


def test_table_selects_the_launcher_and_one_node_is_standalone(torchrun_cli, tmp_path):
    out = tmp_path / "sft"
    torchrun_cli("sft", out, "--data.type", "fake", "--deployment.num-gpus", "4", "--torchrun.local-ranks-filter", "0")
    plan = plan_of(out)
    assert plan["launcher"] == "torchrun"
    command = plan["commands"][0]
    assert command.startswith("torchrun --nnodes 1 --rdzv-backend prime-loopback --rdzv-endpoint 127.0.0.1:0 "
                              "--rdzv-id prime --nproc-per-node 4 --max-restarts 0 --log-dir "
                              f"{out / 'logs' / 'trainer' / 'torchrun' / 'node_0'} --tee 3 --local-ranks-filter 0")
    assert command.endswith(f"-m prime_core sft {out / 'configs' / 'sft.json'}")


def test_seed_sft_multi_node_block_on_the_second_node(torchrun_cli, tmp_path):
    """Seed 000's SFT block (num_nodes = 2, gpus_per_node = 8), run the way seed 001 starts node 1."""
    config = tmp_path / "sft_multi.toml"
    config.write_text('[deployment]\ntype = "multi_node"\nnum_nodes = 2\ngpus_per_node = 8\n\n[data]\ntype = "fake"\n')
    out = tmp_path / "sft"
    env = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "GLOO_SOCKET_IFNAME": "tailscale0",
           "NCCL_SOCKET_IFNAME": "tailscale0"}
    torchrun_cli("sft", out, "@", str(config), "--launcher", "torchrun", "--torchrun.node-rank", "1", env=env)
    plan = plan_of(out, node=1)
    (process,) = plan["processes"]
    argv = process["command"]
    flags = dict(zip(argv[3:-4:2], argv[4:-4:2], strict=False))
    assert flags["--nnodes"] == "2" and flags["--node-rank"] == "1" and flags["--nproc-per-node"] == "8"
    assert flags["--rdzv-endpoint"] == "10.0.0.1:29500" and flags["--rdzv-backend"] == "static"
    assert process["env"]["NCCL_SOCKET_IFNAME"] == process["env"]["GLOO_SOCKET_IFNAME"] == "tailscale0"
    assert plan["placement"][0]["ranks"] == "8..15 of 16"
    assert not (out / "configs" / "plan.json").exists(), "node 1 leaves node 0's plan alone"


def test_several_nodes_need_a_rendezvous_endpoint(torchrun_cli, tmp_path):
    result = torchrun_cli("sft", tmp_path, "--deployment.num-nodes", "2", "--launcher", "torchrun", ok=False)
    assert result.exit_code != 0
    assert "export MASTER_ADDR and MASTER_PORT" in result.output and "--torchrun.rdzv-endpoint" in result.output
    bad = torchrun_cli("sft", tmp_path, "--deployment.num-nodes", "2", "--torchrun.node-rank", "2",
                       "--torchrun.rdzv-endpoint", "h:1", ok=False)
    assert "torchrun.node_rank = 2" in bad.output and "ranks 0..1" in bad.output
    typo = torchrun_cli("sft", tmp_path, "--torchrun.rdzv-endpoint", "no-port", ok=False)
    assert "torchrun.rdzv_endpoint" in typo.output and "HOST:PORT" in typo.output


def test_nnodes_that_disagree_with_the_deployment_are_refused(torchrun_cli, tmp_path):
    result = torchrun_cli("sft", tmp_path / "x", "--deployment.num-nodes", "2", "--torchrun.nnodes", "3",
                          "--torchrun.rdzv-endpoint", "h:1")  # a dry run reports it and goes on
    assert "torchrun.nnodes = 3 but deployment.num_nodes" in result.output


def test_seed_rl_multi_node_block(torchrun_cli, tmp_path):
    """Seed 000's RL block: 2 train nodes, 1 inference node, 8 GPUs each, FSDP islands of 1 node
    (dp_replicate = 2). Node 0 starts the orchestrator and its trainer ranks; inference runs on its
    own node."""
    config = tmp_path / "rl_multi.toml"
    config.write_text('[deployment]\ntype = "multi_node"\nnum_train_nodes = 2\nnum_infer_nodes = 1\n'
                      'gpus_per_node = 8\nnodes_per_fsdp_group = 1\n')
    out = tmp_path / "rl"
    env = {"MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "29500"}
    torchrun_cli("run", out, "@", str(config), "--launcher", "torchrun", env=env)
    plan = plan_of(out)
    assert [p["role"] for p in plan["processes"]] == ["orchestrator", "trainer"]
    assert "prime inference" in " ".join(plan["notes"])
    trainer = json.loads((out / "configs" / "trainer.json").read_text())
    assert trainer["model"]["dp_replicate"] == 2
    torchrun_cli("run", out, "@", str(config), "--launcher", "torchrun", "--torchrun.node-rank", "1", env=env)
    second = plan_of(out, node=1)
    assert [p["role"] for p in second["processes"]] == ["trainer"]
    assert second["placement"][0]["ranks"] == "8..15 of 16"


def test_rl_single_node_places_inference_before_the_trainer(torchrun_cli, tmp_path):
    out = tmp_path / "rl"
    torchrun_cli("run", out, "--launcher", "torchrun", "--deployment.num-infer-gpus", "2",
                 "--deployment.num-train-gpus", "2", "--inference.parallel.dp", "2",
                 env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    plan = plan_of(out)
    gpus = {p["role"]: p["env"].get("CUDA_VISIBLE_DEVICES") for p in plan["processes"]}
    assert gpus == {"inference[0]": "0", "inference[1]": "1", "orchestrator": None, "trainer": "2,3"}
    assert plan["commands"][1].endswith(f"prime inference {out / 'configs' / 'inference_1.json'}")
    assert "--rdzv-endpoint 127.0.0.1:0 --rdzv-id prime --nproc-per-node 2" in plan["commands"][-1]
    assert plan["notes"] == []  # the orchestrator's URLs follow the replicas' ports
    stray = torchrun_cli("run", tmp_path / "stray", "--launcher", "torchrun", "--inference.server.port", "8001",
                         "--orchestrator.client.base-url", "http://127.0.0.1:8000/v1")
    assert "no server of this run listens there (this run's: port 8001)" in " ".join(stray.output.split())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_localhost_match_one_node(tmp_path):
    """Two `prime sft` invocations (node ranks 0 and 1, one rendezvous endpoint) train one
    model together with gloo; the losses equal one node running the same 2 processes."""
    pytest.importorskip("prime_plugin_hf", reason="the hf model plugin provides the model")
    pytest.importorskip("prime_plugin_fsdp", reason="several trainer processes need the fsdp strategy")
    from prime_plugin_hf.tiny import build_tiny

    tiny = build_tiny(tmp_path / "tiny", hidden_size=64, num_layers=1)
    common = [sys.executable, "-m", "prime_core", "sft", "--model.name", str(tiny), "--model.impl", "hf",
              "--model.dtype", "float32", "--data.type", "fake", "--data.batch-size", "4", "--seq-len", "32",
              "--max-steps", "3", "--optim.lr", "1e-3", "--launcher", "torchrun"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GLOO_SOCKET_IFNAME": "lo"}
    for name in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "PRIME_ROLE_PROCESS"):
        env.pop(name, None)
    one = subprocess.run([*common, "--output-dir", str(tmp_path / "one"), "--deployment.num-gpus", "2"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stdout + one.stderr

    endpoint = f"127.0.0.1:{_free_port()}"
    node = [*common, "--output-dir", str(tmp_path / "two"), "--deployment.type", "multi_node",
            "--deployment.num-nodes", "2", "--deployment.gpus-per-node", "1", "--torchrun.rdzv-endpoint", endpoint]
    nodes = [subprocess.Popen([*node, "--torchrun.node-rank", str(rank)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outputs = [p.communicate(timeout=300)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(outputs)

    def losses(out):
        return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]

    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), abs=1e-5)
    assert "2 × cpu" in outputs[0], "node 0 shows its local rank 0 on the console"
    logs = tmp_path / "two" / "logs"
    assert {p.name for p in (logs / "sft").iterdir()} == {"rank_0.log", "rank_1.log"}
    for rank in (0, 1):
        captured = list((logs / "trainer" / "torchrun" / f"node_{rank}").glob("*/attempt_0/0/stdout.log"))
        assert captured, f"torchrun keeps node {rank}'s per-rank output"
    assert "sft: final model written" in (logs / "sft" / "rank_0.log").read_text()
