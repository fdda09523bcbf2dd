"""GPU placement of the local launcher: the seeds' single-node commands, with and without
CUDA_VISIBLE_DEVICES, and the error when a run asks for more GPUs than are visible."""

import json
import os
import stat

import pytest

import prime_plugin_local.plugin as plugin
from prime_core.errors import PrimeError
from prime_core.launch.placement import Request, assign, visible_gpus

pytest_plugins = ["prime_core.testing"]


@pytest.fixture
def no_gpus(monkeypatch, tmp_path):
    """A machine without a driver: no CUDA_VISIBLE_DEVICES, no nvidia-smi on PATH."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))


@pytest.fixture
def fake_nvidia_smi(monkeypatch, tmp_path):
    """A driver that lists ``count`` GPUs (``nvidia-smi -L``), CUDA_VISIBLE_DEVICES unset."""

    def make(count: int):
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir(exist_ok=True)
        script = bin_dir / "nvidia-smi"
        lines = "".join(f"echo 'GPU {i}: NVIDIA H200 (UUID: GPU-{i:04d})'\n" for i in range(count))
        script.write_text(f"#!/bin/sh\n{lines}")
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    return make


def dry_run(prime_cli, register_plugin, out, *args, env=None):
    from prime_core.plugins import get_plugin_manager

    if "local" not in get_plugin_manager().records:
        register_plugin(plugin, name="local")
    result = prime_cli("run", "--output-dir", str(out), *args, "--dry-run", env=env)
    assert result.exit_code == 0, result.output
    plan = json.loads((out / "configs" / "plan.json").read_text())
    gpus = {p["role"]: p["env"].get("CUDA_VISIBLE_DEVICES") for p in plan["processes"]}
    return plan, gpus, result.output


def test_visible_gpus_prefers_cuda_visible_devices(fake_nvidia_smi):
    fake_nvidia_smi(4)
    assert visible_gpus() == ["0", "1", "2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "5,7"}) == ["5", "7"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) is None, "all GPUs hidden: a CPU run"


def test_visible_gpus_without_a_driver_is_none(no_gpus):
    assert visible_gpus() is None


def test_assign_in_order_and_explicit_ids():
    requests = [Request("inference", 2, "deployment.num_infer_gpus"),
                Request("trainer", 1, "deployment.num_train_gpus")]
    assert assign(requests, ["4", "5", "6"]) == {"inference": ["4", "5"], "trainer": ["6"]}
    shared = [Request("inference", 1, "k", ids=("0",)), Request("trainer", 1, "k", ids=("0",))]
    assert assign(shared, ["0"]) == {"inference": ["0"], "trainer": ["0"]}


def test_oversubscription_names_the_keys_and_the_fix(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    requests = [Request("inference", 2, "deployment.num_infer_gpus"),
                Request("trainer", 2, "deployment.num_train_gpus")]
    with pytest.raises(PrimeError) as info:
        assign(requests, ["0", "1"])
    text = str(info.value)
    assert "asks for 4 GPUs (deployment.num_infer_gpus = 2 + deployment.num_train_gpus = 2)" in text
    assert "2 are visible (CUDA_VISIBLE_DEVICES=0,1)" in text
    assert "hint:" in text and "CUDA_VISIBLE_DEVICES" in text.split("hint:")[1]


def test_default_rl_takes_inference_first_then_trainer(prime_cli, register_plugin, fake_nvidia_smi, tmp_path):
    """Seed 001: by default the inference server starts on GPU 0 and the trainer on GPU 1."""
    fake_nvidia_smi(8)
    plan, gpus, output = dry_run(prime_cli, register_plugin, tmp_path / "o")
    assert gpus == {"inference": "0", "orchestrator": None, "trainer": "1"}
    assert "placement (local launcher)" in output
    assert [row["role"] for row in plan["placement"]] == ["inference", "orchestrator", "trainer"]


def test_seed_six_inference_gpus_with_dp_and_two_trainer_gpus(prime_cli, register_plugin, tmp_path):
    """Seed 000: --deployment.num-infer-gpus 6 --deployment.num-train-gpus 2 --inference.parallel.dp 6."""
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    plan, gpus, _ = dry_run(prime_cli, register_plugin, tmp_path / "o", "--deployment.num-infer-gpus", "6",
                            "--deployment.num-train-gpus", "2", "--inference.parallel.dp", "6", env=env)
    assert [gpus[f"inference[{i}]"] for i in range(6)] == ["0", "1", "2", "3", "4", "5"] and gpus["trainer"] == "6,7"
    replicas = [row for row in plan["placement"] if row["role"].startswith("inference")]
    assert [r["gpus"] for r in replicas] == ["0", "1", "2", "3", "4", "5"]
    assert [r["port"] for r in replicas] == list(range(8000, 8006))
    trainer = next(p for p in plan["processes"] if p["role"] == "trainer")
    assert "--nproc-per-node" in trainer["command"] and "2" in trainer["command"]


def test_seed_older_gpu_ids_form(prime_cli, register_plugin, fake_nvidia_smi, tmp_path):
    """Seed 001: --inference-gpu-ids 0,1,2,3,4,5 --trainer-gpu-ids 6,7 --inference.parallel.dp 6."""
    fake_nvidia_smi(8)
    _, gpus, _ = dry_run(prime_cli, register_plugin, tmp_path / "o", "--inference-gpu-ids", "0,1,2,3,4,5",
                         "--trainer-gpu-ids", "6,7", "--inference.parallel.dp", "6")
    assert [gpus[f"inference[{i}]"] for i in range(6)] == ["0", "1", "2", "3", "4", "5"] and gpus["trainer"] == "6,7"


def test_two_replicas_plan_two_servers_two_ports_and_two_urls(prime_cli, register_plugin, no_gpus, tmp_path):
    """inference.parallel.dp = 2: two `prime inference` processes, each on its own resolved
    config (dp 1, consecutive ports), and the orchestrator gets both URLs."""
    out = tmp_path / "o"
    plan, _, output = dry_run(prime_cli, register_plugin, out, "--inference.parallel.dp", "2",
                              "--inference.server.port", "8100")
    configs = out / "configs"
    inference = [p for p in plan["processes"] if p["role"].startswith("inference")]
    assert [p["role"] for p in inference] == ["inference[0]", "inference[1]"]
    assert [p["service"] for p in inference] == [True, True]
    assert [p["may_fail"] for p in inference] == [True, True], "on_replica_failure = 'continue': the run goes on"
    assert plan["commands"][:2] == [f"prime inference {configs / 'inference_0.json'}",
                                    f"prime inference {configs / 'inference_1.json'}"]
    assert [p["log"] for p in inference] == [str(out / "logs" / f"inference_{i}.log") for i in range(2)]
    whole = json.loads((configs / "inference.json").read_text())
    for i in range(2):
        replica = json.loads((configs / f"inference_{i}.json").read_text())
        assert replica["parallel"]["dp"] == 1 and replica["server"]["port"] == 8100 + i
        assert {**replica, "parallel": whole["parallel"], "server": whole["server"]} == whole, "nothing else differs"
    assert whole["parallel"]["dp"] == 2
    orchestrator = json.loads((configs / "orchestrator.json").read_text())
    assert orchestrator["client"]["base_url"] == ["http://127.0.0.1:8100/v1", "http://127.0.0.1:8101/v1"]
    rows = {row["role"]: row for row in plan["placement"]}
    assert (rows["inference[0]"]["port"], rows["inference[1]"]["port"]) == (8100, 8101)
    assert "inference[1]" in output and "8101" in output, "the printed placement shows each replica"

    # Fewer replicas later in the same output_dir: no stale replica file is left behind.
    dry_run(prime_cli, register_plugin, out, "--inference.server.port", "8100")
    assert sorted(p.name for p in configs.glob("inference*.json")) == ["inference.json"]


def test_replicas_end_the_run_when_the_orchestrator_stops_for_them(prime_cli, register_plugin, no_gpus, tmp_path):
    plan, _, _ = dry_run(prime_cli, register_plugin, tmp_path / "o", "--inference.parallel.dp", "2",
                         "--orchestrator.client.on-replica-failure", "stop")
    assert [p["may_fail"] for p in plan["processes"] if p["role"].startswith("inference")] == [False, False]
    one, _, _ = dry_run(prime_cli, register_plugin, tmp_path / "p")
    assert [p["may_fail"] for p in one["processes"] if p["role"] == "inference"] == [False], "one replica is the run"


def test_user_base_url_is_kept_with_replicas(prime_cli, register_plugin, no_gpus, tmp_path):
    out = tmp_path / "o"
    dry_run(prime_cli, register_plugin, out, "--inference.parallel.dp", "2",
            "--orchestrator.client.base-url", "http://gateway:9000/v1")
    orchestrator = json.loads((out / "configs" / "orchestrator.json").read_text())
    assert orchestrator["client"]["base_url"] == ["http://gateway:9000/v1"]


def test_seed_single_gpu_shared_by_both_roles(prime_cli, register_plugin, fake_nvidia_smi, tmp_path):
    """Seed 001: --trainer-gpu-ids 0 --inference-gpu-ids 0 --inference.gpu-memory-utilization 0.5."""
    fake_nvidia_smi(1)
    _, gpus, _ = dry_run(prime_cli, register_plugin, tmp_path / "o", "--trainer-gpu-ids", "0",
                         "--inference-gpu-ids", "0", "--inference.gpu-memory-utilization", "0.5")
    assert gpus["inference"] == "0" and gpus["trainer"] == "0"


def test_a_shared_gpu_with_inference_s_default_memory_share_is_refused(prime_cli, register_plugin, fake_nvidia_smi,
                                                                      tmp_path):
    """vLLM's default share (0.9) of a GPU the trainer also uses would leave the trainer a tenth:
    refused before anything starts, naming the GPU, the roles and the key."""
    from prime_core.plugins import get_plugin_manager

    fake_nvidia_smi(2)
    if "local" not in get_plugin_manager().records:
        register_plugin(plugin, name="local")
    result = prime_cli("run", "--output-dir", str(tmp_path / "o"), "--trainer-gpu-ids", "0,1", "--inference-gpu-ids",
                       "1", "--dry-run")
    out = " ".join(result.output.split())
    assert result.exit_code != 0 and not (tmp_path / "o" / "configs" / "plan.json").exists()
    assert ("GPU 1 is named for inference and for trainer, and inference.gpu_memory_utilization is left at its "
            "default (0.9)") in out, out
    assert "--inference.gpu-memory-utilization 0.5" in out
    _, gpus, _ = dry_run(prime_cli, register_plugin, tmp_path / "p", "--trainer-gpu-ids", "0,1",
                         "--inference-gpu-ids", "1", "--inference.gpu-memory-utilization", "0.9")
    assert gpus["inference"] == "1", "a share set explicitly is taken as meant"


def test_a_client_pointed_at_a_port_no_server_of_the_run_holds_is_noted(prime_cli, register_plugin, tmp_path):
    """Seed 000's second run with its port moved but the first run's URL kept: it would sample from
    the first run's server. Noted in the plan; a URL elsewhere (a gateway) or on the run's port is not."""
    _, _, out = dry_run(prime_cli, register_plugin, tmp_path / "exp2", "--inference.server.port", "8001",
                        "--orchestrator.client.base-url", "http://localhost:8000/v1")
    out = " ".join(out.split())
    assert ("note: orchestrator.client.base_url http://localhost:8000/v1 is on this machine, but no server of this "
            "run listens there (this run's: port 8001)") in out, out
    for url in ("http://localhost:8001/v1", "http://gateway:9000/v1"):
        _, _, out = dry_run(prime_cli, register_plugin, tmp_path / url.split("/")[2].replace(":", "_"),
                            "--inference.server.port", "8001", "--orchestrator.client.base-url", url)
        assert "no server of this run listens" not in out, out


def test_seed_two_runs_side_by_side(prime_cli, register_plugin, tmp_path):
    """Seed 000: two runs on one node, each pinned to half the GPUs, its own port and output_dir."""
    one, gpus_one, _ = dry_run(prime_cli, register_plugin, tmp_path / "exp1", env={"CUDA_VISIBLE_DEVICES": "0,1"})
    two, gpus_two, _ = dry_run(prime_cli, register_plugin, tmp_path / "exp2", "--inference.server.port", "8001",
                               "--orchestrator.client.base-url", "http://localhost:8001/v1",
                               env={"CUDA_VISIBLE_DEVICES": "2,3"})
    assert (gpus_one["inference"], gpus_one["trainer"]) == ("0", "1")
    assert (gpus_two["inference"], gpus_two["trainer"]) == ("2", "3")
    ports = [next(r for r in plan["placement"] if r["role"] == "inference")["port"] for plan in (one, two)]
    assert ports == [8000, 8001]
    orch = json.loads((tmp_path / "exp2" / "configs" / "orchestrator.json").read_text())
    assert orch["client"]["base_url"] == ["http://localhost:8001/v1"]
    inference = json.loads((tmp_path / "exp2" / "configs" / "inference.json").read_text())
    assert inference["server"]["port"] == 8001
    assert {one["output_dir"], two["output_dir"]} == {str(tmp_path / "exp1"), str(tmp_path / "exp2")}


def test_seed_second_experiment_with_explicit_ids(prime_cli, register_plugin, fake_nvidia_smi, tmp_path):
    """Seed 001: --inference-gpu-ids 2 --trainer-gpu-ids 3 --inference.server.port 8001 ... --output-dir outputs2."""
    fake_nvidia_smi(4)
    _, gpus, _ = dry_run(prime_cli, register_plugin, tmp_path / "outputs2", "--inference-gpu-ids", "2",
                         "--trainer-gpu-ids", "3", "--inference.server.port", "8001",
                         "--orchestrator.client.base-url", "http://localhost:8001/v1")
    assert gpus["inference"] == "2" and gpus["trainer"] == "3"


def test_too_many_gpus_is_refused_before_anything_starts(prime_cli, register_plugin, tmp_path):
    register_plugin(plugin, name="local")
    result = prime_cli("run", "--output-dir", str(tmp_path / "o"), "--deployment.num-infer-gpus", "6",
                       "--deployment.num-train-gpus", "2", "--dry-run", env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert result.exit_code != 0
    assert "asks for 8 GPUs (deployment.num_infer_gpus = 6 + deployment.num_train_gpus = 2)" in result.output
    assert "4 are visible (CUDA_VISIBLE_DEVICES=0,1,2,3)" in result.output


def test_inference_dp_larger_than_its_gpus_is_refused(prime_cli, register_plugin, tmp_path):
    register_plugin(plugin, name="local")
    result = prime_cli("run", "--output-dir", str(tmp_path / "o"), "--inference.parallel.dp", "2", "--dry-run",
                       env={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert result.exit_code != 0
    assert "inference.parallel.tp × dp = 1 × 2 = 2 GPUs" in result.output
    assert "deployment.num_infer_gpus" in result.output


def test_cpu_machine_sets_no_devices(prime_cli, register_plugin, no_gpus, tmp_path):
    plan, gpus, _ = dry_run(prime_cli, register_plugin, tmp_path / "o")
    assert set(gpus.values()) == {None}
    assert {row["gpus"] for row in plan["placement"]} <= {"cpu", "-"}


def test_sft_on_two_gpus_takes_the_first_two_visible(prime_cli, register_plugin, tmp_path):
    register_plugin(plugin, name="local")
    out = tmp_path / "sft"
    result = prime_cli("sft", "--data.type", "fake", "--deployment.num-gpus", "2", "--output-dir", str(out),
                       "--dry-run", env={"CUDA_VISIBLE_DEVICES": "4,5,6"})
    assert result.exit_code == 0, result.output
    plan = json.loads((out / "configs" / "plan.json").read_text())
    (process,) = plan["processes"]
    assert process["env"]["CUDA_VISIBLE_DEVICES"] == "4,5" and plan["inline"] is False
    assert plan["commands"][0].endswith("--rdzv-endpoint 127.0.0.1:0 --rdzv-id prime --nproc-per-node 2 "
                                        f"-m prime_core sft "
                                        f"{out / 'configs' / 'sft.json'}")
    assert "dry_run" not in json.loads((out / "configs" / "sft.json").read_text()), "the written config runs for real"


def test_one_process_sft_runs_inline(prime_cli, register_plugin, no_gpus, tmp_path):
    register_plugin(plugin, name="local")
    out = tmp_path / "sft"
    assert prime_cli("sft", "--data.type", "fake", "--output-dir", str(out), "--dry-run").exit_code == 0
    plan = json.loads((out / "configs" / "plan.json").read_text())
    assert plan["inline"] is True and plan["commands"] == [f"prime sft {out / 'configs' / 'sft.json'}"]


def test_inference_root_plans_one_server(prime_cli, register_plugin, tmp_path):
    register_plugin(plugin, name="local")
    out = tmp_path / "inf"
    result = prime_cli("inference", "--deployment.num-gpus", "2", "--parallel.tp", "2", "--output-dir", str(out),
                       "--dry-run", env={"CUDA_VISIBLE_DEVICES": "3,4"})
    assert result.exit_code == 0, result.output
    plan = json.loads((out / "configs" / "plan.json").read_text())
    assert plan["inline"] is True and plan["processes"][0]["env"]["CUDA_VISIBLE_DEVICES"] == "3,4"
    multi = prime_cli("inference", "--deployment.type", "multi_node", "--output-dir", str(out), "--dry-run")
    assert multi.exit_code == 2 and "independent replica" in multi.output


def test_inference_root_with_replicas_starts_one_process_each(prime_cli, register_plugin, tmp_path):
    register_plugin(plugin, name="local")
    out = tmp_path / "inf"
    result = prime_cli("inference", "--deployment.num-gpus", "4", "--parallel.tp", "2", "--parallel.dp", "2",
                       "--output-dir", str(out), "--dry-run", env={"CUDA_VISIBLE_DEVICES": "3,4,5,6"})
    assert result.exit_code == 0, result.output
    plan = json.loads((out / "configs" / "plan.json").read_text())
    assert plan["inline"] is False
    assert [(p["role"], p["env"]["CUDA_VISIBLE_DEVICES"], p["service"]) for p in plan["processes"]] == [
        ("inference[0]", "3,4", False), ("inference[1]", "5,6", False)]
    assert plan["commands"][1] == f"CUDA_VISIBLE_DEVICES=5,6 prime inference {out / 'configs' / 'inference_1.json'}"
    assert json.loads((out / "configs" / "inference_1.json").read_text())["server"]["port"] == 8001
