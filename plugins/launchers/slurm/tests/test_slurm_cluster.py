"""`prime sft` with a [slurm] table against a real slurmctld + slurmd on localhost (see
conftest.py): the job is submitted with sbatch, runs a small CPU SFT inside the allocation,
and leaves its logs where the README says."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("prime_plugin_hf", reason="the hf model plugin provides the model implementation")
pytest.importorskip("jinja2", reason="the slurm launcher renders its scripts with Jinja2")


@pytest.fixture(scope="module")
def sft_inputs(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny model and a small chat dataset, built here (nothing is downloaded)."""
    from prime_plugin_hf.tiny import build_tiny

    root = tmp_path_factory.mktemp("sft-inputs")
    model = build_tiny(root / "tiny", hidden_size=64, num_layers=1)
    data = root / "data.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"{a}+{b}"}, {"role": "assistant", "content": str(a + b)}]}
            for a in range(4) for b in range(4)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, data


def write_config(path: Path, model: Path, data: Path, *, job_name: str, deployment: str = "") -> Path:
    path.write_text(f"""\
max_steps = 4
seq_len = 128

[model]
name = "{model}"
impl = "hf"
dtype = "float32"

[data]
path = "{data}"
batch_size = 8

[optim]
lr = 1e-3

[slurm]
job_name = "{job_name}"
time = "00:15:00"
request_gpus = false   # a CPU-only partition: no GPUs to ask for
{deployment}""")
    return path


def prime(cluster, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prime_core", *args], capture_output=True, text=True, cwd=cwd,
                          env={**cluster.env, "HF_HUB_OFFLINE": "1"}, timeout=300)


def submit(cluster, config: Path, out: Path) -> str:
    result = prime(cluster, "sft", str(config), "--output-dir", str(out), cwd=config.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    match = re.search(r"submitted batch job (\d+)", result.stdout)
    assert match, result.stdout
    assert f"bash {out}/slurm/tmux.sh" in result.stdout
    return match.group(1)


def finished(cluster, job_id: str, out: Path, timeout: float = 420) -> str:
    state = cluster.wait(job_id, timeout)
    job_log = out / "slurm" / f"job_{job_id}.log"
    logs = "\n".join(f"--- {p}\n{p.read_text()[-4000:]}" for p in sorted((out / "slurm").rglob("*.log"))
                     if p.is_file() and not p.is_symlink())
    assert state == "COMPLETED", f"job {job_id}: {state}\n{logs}\n{cluster.daemon_logs()}"
    return job_log.read_text()


def test_sft_job_runs_inside_the_allocation(slurm_cluster, sft_inputs, tmp_path):
    model, data = sft_inputs
    config = write_config(tmp_path / "sft.toml", model, data, job_name="prime-sft-test")
    out = tmp_path / "out"

    # --dry-run writes the script and the configs and submits nothing.
    before = slurm_cluster.jobs()
    dry = prime(slurm_cluster, "sft", str(config), "--output-dir", str(out), "--dry-run", cwd=tmp_path)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert (out / "sft.sh").exists() and (out / "configs" / "sft.json").exists()
    assert "submitted" not in dry.stdout and slurm_cluster.jobs() == before

    job_id = submit(slurm_cluster, config, out)
    job_log = finished(slurm_cluster, job_id, out)
    assert f"job {job_id} on " in job_log and "train_node_rank_0 exited with code 0" in job_log
    assert "run finished" in job_log

    slurm = out / "slurm"
    latest = slurm / "latest_train_node_rank_0.log"
    assert latest.is_symlink() and os.readlink(latest) == f"job_{job_id}/train_node_rank_0.log"
    assert "final model written" in latest.read_text()
    assert (slurm / "latest.log").resolve() == (slurm / f"job_{job_id}.log").resolve()
    assert (slurm / "latest_job_id").read_text().strip() == job_id
    assert json.loads((slurm / "submitted.jsonl").read_text().splitlines()[-1])["job_id"] == job_id
    # The training itself: every step's metrics, and the final model.
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert (out / "model" / "config.json").exists()


def test_multi_node_script_runs_torchrun_through_srun(slurm_cluster, sft_inputs, tmp_path):
    """The multi-node template on a one-node allocation: node list from scontrol, srun per
    node, torchrun with the rendezvous on the first train node, two gloo processes."""
    model, data = sft_inputs
    config = write_config(tmp_path / "sft.toml", model, data, job_name="prime-sft-mn",
                          deployment="\n[deployment]\ntype = \"multi_node\"\nnum_nodes = 1\ngpus_per_node = 2\n")
    out = tmp_path / "out"
    job_id = submit(slurm_cluster, config, out)
    job_log = finished(slurm_cluster, job_id, out)
    assert "trainer on: localhost" in job_log
    rank0 = (out / "slurm" / "latest_train_node_rank_0.log").read_text()
    assert "2 × cpu" in rank0 and "final model written" in rank0
    per_rank = list((out / "logs" / "sft" / "torchrun" / "node_0").rglob("stdout.log"))
    assert len(per_rank) == 2, per_rank
    assert (out / "model" / "config.json").exists()


def test_a_failing_role_fails_the_job_and_names_itself(slurm_cluster, sft_inputs, tmp_path):
    model, data = sft_inputs
    broken = tmp_path / "broken-model"  # passes the config's checks; no architecture loads it
    shutil.copytree(model, broken)
    (broken / "config.json").write_text("{}")  # no model_type
    config = write_config(tmp_path / "sft.toml", broken, data, job_name="prime-sft-fails")
    out = tmp_path / "out"
    job_id = submit(slurm_cluster, config, out)
    assert slurm_cluster.wait(job_id, 300) == "FAILED"
    job_log = (out / "slurm" / f"job_{job_id}.log").read_text()
    assert "train_node_rank_0 failed" in job_log and "model_type" in job_log and "run failed" in job_log
