"""prime-plugin-slurm without a cluster: the [slurm] table, launcher selection, and the
scripts rendered for the seeds' SLURM examples, the multi-node deployment blocks, custom
templates and the errors a user can cause. (test_slurm_cluster.py submits for real.)"""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import prime_plugin_slurm.plugin as plugin
from prime_core import PLUGIN_API_VERSION

pytest_plugins = ["prime_core.testing"]

SEEDS = Path(__file__).resolve().parents[4] / "examples" / "seeds"


@pytest.fixture
def slurm(installed_plugins):
    """Every installed plugin: the seeds use keys of the strategy plugins too."""
    return installed_plugins


@pytest.fixture
def tripwire(tmp_path, monkeypatch):
    """An ``sbatch`` first on PATH that records any call: a dry run must never reach it."""
    bin_dir = tmp_path / "tripwire-bin"
    bin_dir.mkdir()
    calls = tmp_path / "sbatch-calls"
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\necho "$@" >> {calls}\necho 1\n')
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return calls


def dry_run(prime_cli, command, *args, out):
    result = prime_cli(command, *args, "--output-dir", str(out), "--dry-run")
    assert result.exit_code == 0, result.output
    assert "dry run: nothing started" in result.output
    return result


def bash_syntax_ok(script: Path) -> None:
    check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def notes(out: Path) -> list[str]:
    return read(out / "configs" / "plan.json")["notes"]


def test_declares_the_plugin_api():
    assert plugin.PRIME_PLUGIN_API == PLUGIN_API_VERSION


def test_overlay_loads(slurm, prime_cli):
    result = prime_cli("config", "show", "--format", "json", str(SEEDS / "slurm_overlay.toml"))
    assert result.exit_code == 0, result.output
    assert '"job_name": "my-rl-run"' in result.output


def test_flat_legacy_keys_move_to_slurm_and_deployment(slurm, prime_cli):
    result = prime_cli("config", "show", "--format", "json", str(SEEDS / "slurm_moe_hendrycks.toml"))
    assert result.exit_code == 0, result.output
    assert '"job_name": "hendrycks-math-moe"' in result.output
    assert '"type": "multi_node"' in result.output


def test_template_path_must_exist(slurm, prime_cli):
    result = prime_cli("config", "show", "--slurm.template-path", "/nonexistent/t.sh.j2")
    assert result.exit_code == 2
    assert "slurm.template_path" in result.output and "file not found" in result.output


def test_unknown_without_the_plugin(plugin_manager, prime_cli):
    result = prime_cli("config", "show", str(SEEDS / "slurm_overlay.toml"))
    assert result.exit_code == 2
    assert "slurm" in result.output and "unknown key" in result.output


def test_a_slurm_table_selects_the_launcher(slurm):
    from prime_core.config.checks import resolve_launcher
    from prime_core.config.cli_args import parse_args
    from prime_core.config.load import load

    with_table, _ = load("rl", parse_args(["--slurm.job-name", "x"]), manager=slurm)
    assert resolve_launcher(with_table, slurm) == "slurm"
    for root in ("sft", "inference"):
        config, _ = load(root, parse_args(["--slurm.job-name", "x"]), manager=slurm)
        assert plugin.prime_select_launcher(config) == "slurm"
    without, _ = load("rl", parse_args([]), manager=slurm)
    assert plugin.prime_select_launcher(without) is None


def test_dense_seed_renders_one_inference_node_and_one_train_node(slurm, prime_cli, tmp_path, tripwire):
    """The SLURM docs' dense example: 1 train + 1 inference node, 8 GPUs each, DP 8 (eight
    replicas on the inference node, every URL given to the orchestrator)."""
    out = tmp_path / "out"
    dry_run(prime_cli, "run", "@", str(SEEDS / "slurm_dense_hendrycks.toml"), out=out)
    script = out / "rl.sh"
    text = script.read_text()
    assert f"sbatch script: {script} (multi-node default template)" in notes(out)
    for line in ("#SBATCH --job-name=hendrycks-math", "#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8",
                 f"#SBATCH --output={out}/slurm/job_%j.log", "#SBATCH --exclusive",
                 "INFER_HOSTS=(${HOSTS[@]:0:1})", "TRAIN_HOSTS=(${HOSTS[@]:1:1})",
                 'scontrol show hostnames "$SLURM_JOB_NODELIST"', "export PRIME_ROLE_PROCESS=1",
                 'start "infer_node_rank_${i}_replica_7" service on "${INFER_HOSTS[$i]}" bash -c "$SLICE" slice 7 1',
                 f'-m prime_core inference {out}/configs/inference_7.json '
                 '--server.host "$(address "${INFER_HOSTS[$i]}")"',
                 'URLS+=("http://${INFER_HOSTS[$i]}:8007/v1")',
                 f'-m prime_core orchestrator {out}/configs/orchestrator.json --client.base-url "${{URLS[@]}}"',
                 "--nnodes 1 --node-rank \"$r\" --nproc-per-node 8",
                 'RDZV_ENDPOINT="${TRAIN_HOSTS[0]}:29500"', f"-m prime_core trainer {out}/configs/trainer.json"):
        assert line in text, line
    assert "#SBATCH --partition" not in text and "#SBATCH --account" not in text
    bash_syntax_ok(script)
    assert read(out / "configs" / "inference.json")["parallel"] == {"tp": 1, "dp": 8}
    assert read(out / "configs" / "inference_7.json")["parallel"] == {"tp": 1, "dp": 1}
    assert read(out / "configs" / "inference_7.json")["server"]["port"] == 8007
    assert [row["port"] for row in read(out / "configs" / "plan.json")["placement"][:8]] == list(range(8000, 8008))
    # Each replica sees one slice of the GPUs its step sees on the node (all 8 when unset).
    slice_script = re.search(r"^SLICE='(.*)'$", text, re.MULTILINE).group(1)
    for visible, expected in (("4,5,6,7,8,9,10,11", "11"), (None, "7")):
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        env.update({"CUDA_VISIBLE_DEVICES": visible} if visible else {})
        got = subprocess.run(["bash", "-c", slice_script, "slice", "7", "1", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES"],
                             capture_output=True, text=True, env=env).stdout.strip()
        assert got == expected
    assert read(out / "configs" / "orchestrator.json")["batch_size"] == 128
    assert read(out / "configs" / "trainer.json")["max_steps"] == 500
    assert (out / "slurm" / "tmux.sh").exists()
    assert (out / "slurm" / "panes").read_text().split() == [
        "latest_train_node_rank_*.log", "latest_orchestrator.log", "latest_infer_node_rank_*.log"]
    assert read(out / "configs" / "plan.json")["script"] == str(script)
    assert not tripwire.exists(), "a dry run called sbatch"
    assert not (out / "slurm" / "submitted.jsonl").exists()


def test_moe_seed_keeps_its_memory_knobs_and_tp4_dp2(slurm, prime_cli, tmp_path, tripwire):
    out = tmp_path / "out"
    dry_run(prime_cli, "run", "@", str(SEEDS / "slurm_moe_hendrycks.toml"), out=out)
    text = (out / "rl.sh").read_text()
    assert "#SBATCH --job-name=hendrycks-math-moe" in text and "#SBATCH --nodes=2" in text
    bash_syntax_ok(out / "rl.sh")
    trainer = read(out / "configs" / "trainer.json")
    model = trainer["model"]
    assert model["impl"] == "custom" and model["attn"] == "flash_attention_3" and model["optim_cpu_offload"] is True
    assert model["ac"]["freq"] == 1 and model["ac_offloading"]["max_inflight_activations"] == 5
    assert trainer["weight_broadcast"]["type"] == "nccl"
    assert read(out / "configs" / "inference.json")["parallel"] == {"tp": 4, "dp": 2}
    assert read(out / "configs" / "orchestrator.json")["batch_size"] == 512
    assert not tripwire.exists()


def test_multi_node_rl_block_with_fsdp_islands(slurm, prime_cli, tmp_path, tripwire):
    """Scaling guide: 2 train nodes, 1 inference node, 8 GPUs each, one node per FSDP island."""
    out = tmp_path / "out"
    dry_run(prime_cli, "run", "@", str(SEEDS / "multinode_rl.toml"), "@", str(SEEDS / "slurm_overlay.toml"),
            "--model.name", "Qwen/Qwen3-30B-A3B", out=out)
    text = (out / "rl.sh").read_text()
    for line in ("#SBATCH --job-name=my-rl-run", "#SBATCH --nodes=3", "INFER_HOSTS=(${HOSTS[@]:0:1})",
                 "TRAIN_HOSTS=(${HOSTS[@]:1:2})", "--nnodes 2 --node-rank \"$r\" --nproc-per-node 8",
                 'start orchestrator main on "${TRAIN_HOSTS[0]}"'):
        assert line in text, line
    bash_syntax_ok(out / "rl.sh")
    assert read(out / "configs" / "trainer.json")["model"]["dp_replicate"] == 2


def test_single_node_placement_of_the_scaling_guide(slurm, prime_cli, tmp_path):
    """`--deployment.num-infer-gpus 6 --deployment.num-train-gpus 2 --inference.parallel.dp 6`
    under [slurm]: one node, 8 GPUs, inference on the first 6, the trainer on 2 under torchrun."""
    out = tmp_path / "out"
    dry_run(prime_cli, "run", "--slurm.job-name", "ab", "--slurm.partition", "gpu", "--slurm.account", "team",
            "--slurm.time", "24:00:00", "--slurm.nodelist", "node07", "--slurm.pre-run-command",
            "module load cuda/12.8", "--slurm.sbatch-options", '{"qos": "high", "mem": "0", "requeue": true}',
            "--deployment.num-infer-gpus", "6", "--deployment.num-train-gpus", "2",
            "--inference.parallel.dp", "6", "--model.name", "m", out=out)
    text = (out / "rl.sh").read_text()
    for line in ("#SBATCH --nodes=1", "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gpu",
                 "#SBATCH --account=team", "#SBATCH --time=24:00:00", "#SBATCH --nodelist=node07",
                 "#SBATCH --qos=high", "#SBATCH --mem=0", "#SBATCH --requeue", "module load cuda/12.8",
                 'INFER_GPUS=$(IFS=,; echo "${GPUS[*]:0:6}")', 'TRAIN_GPUS=$(IFS=,; echo "${GPUS[*]:6:2}")',
                 'env CUDA_VISIBLE_DEVICES="$TRAIN_GPUS" "$PYTHON" -m torch.distributed.run --nnodes 1 '
                 '--rdzv-backend prime-loopback --rdzv-endpoint 127.0.0.1:0',
                 "--nproc-per-node 2", f"--log-dir {out}/logs/trainer/torchrun --tee 3 --local-ranks-filter 0"):
        assert line in text, line
    replica = ('start infer_node_rank_0_replica_5 service env '
               'CUDA_VISIBLE_DEVICES="$(IFS=,; echo "${INFER_GPU_LIST[*]:5:1}")" '
               f'"$PYTHON" -m prime_core inference {out}/configs/inference_5.json')
    assert replica in text and 'IFS=, read -r -a INFER_GPU_LIST <<< "$INFER_GPUS"' in text
    got = subprocess.run(["bash", "-c", 'INFER_GPUS=2,3,4,5,6,7; IFS=, read -r -a INFER_GPU_LIST <<< "$INFER_GPUS"; '
                                        'echo "$(IFS=,; echo "${INFER_GPU_LIST[*]:5:1}")"'],
                         capture_output=True, text=True).stdout.strip()
    assert got == "7"
    assert "srun" not in text.split("supervise()")[-1], "one node: the roles start without srun"
    assert "--server.host" not in text, "the orchestrator is on the same node"
    bash_syntax_ok(out / "rl.sh")


def test_multi_node_sft_block(slurm, prime_cli, tmp_path, tripwire):
    out = tmp_path / "out"
    dry_run(prime_cli, "sft", str(SEEDS / "multinode_sft.toml"), "--slurm.job-name", "sft-moe", out=out)
    script = out / "sft.sh"
    text = script.read_text()
    assert f"sbatch script: {script} (multi-node default template)" in notes(out)
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8", "TRAIN_HOSTS=(${HOSTS[@]:0:2})",
                 "--nnodes 2 --node-rank \"$r\" --nproc-per-node 8", "--rdzv-endpoint \"$RDZV_ENDPOINT\"",
                 f"-m prime_core sft {out}/configs/sft.json", f"--log-dir {out}/logs/sft/torchrun/node_$r"):
        assert line in text, line
    assert "orchestrator" not in text.split("supervise()")[-1] and "infer_node_rank" not in text
    assert (out / "slurm" / "panes").read_text().split() == ["latest_train_node_rank_*.log"]
    bash_syntax_ok(script)
    assert read(out / "configs" / "sft.json")["deployment"]["num_nodes"] == 2
    assert not tripwire.exists()


def test_multi_node_inference_runs_one_server_per_node(slurm, prime_cli, tmp_path, tripwire):
    out = tmp_path / "out"
    dry_run(prime_cli, "inference", "--slurm.job-name", "serve", "--deployment.type", "multi_node",
            "--deployment.num-nodes", "3", "--deployment.gpus-per-node", "4", "--parallel.tp", "4",
            "--model.name", "m", "--server.port", "8100", out=out)
    text = (out / "inference.sh").read_text()
    for line in ("#SBATCH --nodes=3", "#SBATCH --gpus-per-node=4", "INFER_HOSTS=(${HOSTS[@]:0:3})",
                 'start "infer_node_rank_$i" main on "${INFER_HOSTS[$i]}"',
                 f'-m prime_core inference {out}/configs/inference_node.json '
                 '--server.host "$(address "${INFER_HOSTS[$i]}")"',
                 'URLS+=("http://${INFER_HOSTS[$i]}:8100/v1")', "latest_inference_urls.txt"):
        assert line in text, line
    bash_syntax_ok(out / "inference.sh")
    node = read(out / "configs" / "inference_node.json")
    assert node["deployment"] == {"type": "single_node", "num_gpus": 4} and node["slurm"] is None


def test_multi_node_inference_runs_every_replica_on_every_node(slurm, prime_cli, tmp_path, tripwire):
    out = tmp_path / "out"
    dry_run(prime_cli, "inference", "--slurm.job-name", "serve", "--deployment.type", "multi_node",
            "--deployment.num-nodes", "3", "--deployment.gpus-per-node", "4", "--parallel.tp", "2",
            "--parallel.dp", "2", "--model.name", "m", "--server.port", "8100", out=out)
    text = (out / "inference.sh").read_text()
    for line in ('start "infer_node_rank_${i}_replica_0" main on "${INFER_HOSTS[$i]}" bash -c "$SLICE" slice 0 2',
                 f'-m prime_core inference {out}/configs/inference_node_0.json '
                 '--server.host "$(address "${INFER_HOSTS[$i]}")"',
                 'start "infer_node_rank_${i}_replica_1" main on "${INFER_HOSTS[$i]}" bash -c "$SLICE" slice 2 2',
                 f'-m prime_core inference {out}/configs/inference_node_1.json '
                 '--server.host "$(address "${INFER_HOSTS[$i]}")"',
                 'URLS+=("http://${INFER_HOSTS[$i]}:8100/v1")', 'URLS+=("http://${INFER_HOSTS[$i]}:8101/v1")'):
        assert line in text, line
    bash_syntax_ok(out / "inference.sh")
    for i in range(2):
        replica = read(out / "configs" / f"inference_node_{i}.json")
        assert replica["parallel"] == {"tp": 2, "dp": 1} and replica["server"]["port"] == 8100 + i
        assert replica["deployment"] == {"type": "single_node", "num_gpus": 4} and replica["slurm"] is None
    too_big = prime_cli("inference", "--slurm.job-name", "serve", "--deployment.type", "multi_node",
                        "--deployment.gpus-per-node", "4", "--parallel.tp", "4", "--parallel.dp", "2",
                        "--output-dir", str(tmp_path / "o2"))
    assert too_big.exit_code == 2 and "do not fit in one node" in too_big.output
    assert not tripwire.exists()


def test_custom_template_gets_the_documented_variables(slurm, prime_cli, tmp_path):
    from prime_plugin_slurm.script import TEMPLATE_VARIABLES

    template = tmp_path / "tpl" / "my.sbatch.j2"
    template.parent.mkdir()
    template.write_text("#!/bin/bash\n#SBATCH --job-name={{ job_name }}\n#SBATCH --constraint=h200\n"
                        + "".join(f"# {name}={{{{ {name} }}}}\n" for name in TEMPLATE_VARIABLES)
                        + '{% include "prime_functions.sh.j2" %}\necho custom\n')
    out = tmp_path / "out"
    dry_run(prime_cli, "run", "--slurm.job-name", "mine", "--slurm.template-path", str(template),
                     "--model.name", "m", out=out)
    assert f"sbatch script: {out / 'rl.sh'} (custom template {template})" in notes(out)
    text = (out / "rl.sh").read_text()
    assert "#SBATCH --constraint=h200" in text and "echo custom" in text and "# job_name=mine" in text
    assert f"# config_dir={out}/configs" in text and "# kind=rl" in text and "# num_train_gpus=1" in text
    assert "supervise()" in text, "custom templates can include the default helpers"
    bash_syntax_ok(out / "rl.sh")

    template.write_text("#SBATCH --job-name={{ jobname }}\n")
    bad = prime_cli("run", "--slurm.job-name", "mine", "--slurm.template-path", str(template),
                    "--output-dir", str(out), "--dry-run")
    assert bad.exit_code == 2
    assert f"slurm.template_path = {template}" in bad.output and "'jobname' is undefined" in bad.output
    assert "config_dir" in bad.output, "the error lists the variables a template gets"


def test_missing_sbatch_names_the_fix(slurm, prime_cli, tmp_path, monkeypatch):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    out = tmp_path / "out"
    result = prime_cli("sft", "--slurm.job-name", "x", "--output-dir", str(out))
    assert result.exit_code == 2, result.output
    assert "sbatch not found on PATH" in result.output and "apt-get install slurm-client" in result.output
    assert "--dry-run" in result.output and (out / "sft.sh").exists()


def test_sbatch_output_parsing():
    assert plugin.parse_job_id("4242\n") == "4242"
    assert plugin.parse_job_id("17;cluster-a\n") == "17"
    with pytest.raises(ValueError):
        plugin.parse_job_id("sbatch: error: Batch job submission failed\n")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux)")
def test_tmux_helper_opens_a_pane_per_log_stream(tmp_path):
    from prime_plugin_slurm.script import TMUX_SCRIPT

    logs = tmp_path / "out" / "slurm"
    (logs / "job_7").mkdir(parents=True)
    for name in ("train_node_rank_0", "train_node_rank_1", "orchestrator", "infer_node_rank_0"):
        (logs / "job_7" / f"{name}.log").write_text(f"hello from {name}\n")
        (logs / f"latest_{name}.log").symlink_to(f"job_7/{name}.log")
    env = {**os.environ, "TMUX_TMPDIR": str(tmp_path), "PRIME_TMUX_DETACHED": "1"}
    env.pop("TMUX", None)
    tmux = ["tmux"]
    try:
        run = subprocess.run(["bash", str(TMUX_SCRIPT), "demo", str(tmp_path / "out")], env=env,
                             capture_output=True, text=True, timeout=30)
        assert run.returncode == 0, run.stderr
        windows = subprocess.run([*tmux, "list-windows", "-t", "slurm-demo", "-F", "#W"], env=env,
                                 capture_output=True, text=True).stdout.split()
        assert windows == ["Terminal", "Logs"]
        panes = subprocess.run([*tmux, "list-panes", "-t", "slurm-demo:Logs", "-F", "#{pane_id}"], env=env,
                               capture_output=True, text=True).stdout.split()
        assert len(panes) == 3
        import time

        deadline = time.monotonic() + 10
        screens = []
        while time.monotonic() < deadline:
            screens = [subprocess.run([*tmux, "capture-pane", "-p", "-J", "-t", pane], env=env, capture_output=True,
                                      text=True).stdout for pane in panes]
            if all("hello from" in s for s in screens):
                break
            time.sleep(0.2)
        assert "train_node_rank_0" in screens[0] and "train_node_rank_1" in screens[0]
        assert "hello from orchestrator" in screens[1] and "hello from infer_node_rank_0" in screens[2]
    finally:
        subprocess.run([*tmux, "kill-server"], env=env, capture_output=True)
