"""The multi-process trainer and benchmark mode from the command line, on CPU with gloo:
`--bench` tables and JSON, `prime run --bench` under torchrun, SFT on 2 processes with
per-rank logs and a sharded checkpoint that resumes elsewhere."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("prime_plugin_hf", reason="the hf model plugin provides the model implementation")
pytest.importorskip("prime_plugin_fsdp", reason="multi-process training needs the fsdp strategy")

ROOT = Path(__file__).resolve().parents[1]


def prime(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "prime_core", *args], capture_output=True, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600, cwd=cwd)
    assert result.returncode == 0, f"prime {' '.join(args)}: exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from prime_plugin_hf.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("m") / "tiny", hidden_size=64, num_layers=2)


def test_trainer_bench_prints_a_table_and_saves_json(tiny, tmp_path):
    out = tmp_path / "bench.json"
    result = prime("trainer", "--model.name", str(tiny), "--model.impl", "hf", "--model.dtype", "float32",
                   "--seq-len", "64", "--data.fake.batch-size", "3", "--data.fake.length", "variable",
                   "--bench", "--bench.output-json", str(out), "--output-dir", str(tmp_path / "run"))
    for label in ("step time", "tokens/s", "MFU", "peak memory"):
        assert label in result.stdout
    data = json.loads(out.read_text())
    assert data["steps"] == 3 and data["warmup_steps"] == 2 and data["devices"] == 1
    assert 0 < data["tokens_per_step"] <= 3 * 64 and data["tokens_per_s"] > 0
    assert 0 < data["mfu"] < 1 and data["peak_flops_source"] == "measured (matmul)"
    assert data["peak_memory_gib"] > 0 and 0 < data["peak_memory_pct"] < 100
    assert not (tmp_path / "run" / "metrics.jsonl").exists(), "a benchmark writes no training metrics"


def test_run_bench_starts_only_the_trainer_under_torchrun(tiny, tmp_path):
    out = tmp_path / "run"
    args = ["run", str(ROOT / "examples" / "cpu" / "rl.toml"), "--model.name", str(tiny), "--output-dir", str(out),
            "--deployment.num-train-gpus", "2", "--bench", "--bench.output-json", str(tmp_path / "b.json"),
            "--seq-len", "64", "--trainer.data.fake.batch-size", "4"]
    prime(*args, "--dry-run")
    plan = json.loads((out / "configs" / "plan.json").read_text())
    assert [p["role"] for p in plan["processes"]] == ["trainer"]
    assert plan["commands"][0].startswith("torchrun --nnodes 1 --rdzv-backend prime-loopback --rdzv-endpoint "
                                          "127.0.0.1:0 --rdzv-id prime --nproc-per-node 2 -m prime_core trainer")
    prime(*args)
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["devices"] == 2 and data["tokens_per_step"] == 4 * 64
    assert (out / "logs" / "trainer" / "rank_1.log").exists()


def test_sft_on_two_processes_logs_per_rank_and_resumes_on_one(tiny, tmp_path):
    """Two gloo processes train, checkpoint (sharded) and write a full model; the checkpoint
    loads in one process, which continues with the same weights the two processes had."""
    import torch
    from safetensors.torch import load_file

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{i}+1"},
                                                    {"role": "assistant", "content": str(i + 1)}]}) + "\n"
                            for i in range(40)))
    out = tmp_path / "sft"
    common = ["sft", "--model.name", str(tiny), "--model.impl", "hf", "--model.dtype", "float32",
              "--data.path", str(data), "--data.batch-size", "8", "--seq-len", "64", "--optim.lr", "1e-3"]
    result = prime(*common, "--output-dir", str(out), "--max-steps", "4", "--ckpt.interval", "4",
                   "--deployment.num-gpus", "2")
    command = json.loads((out / "configs" / "plan.json").read_text())["commands"][0]
    assert "--rdzv-backend prime-loopback --rdzv-endpoint 127.0.0.1:0 --rdzv-id prime --nproc-per-node 2" in command
    assert "2 × cpu" in result.stdout
    assert {p.name for p in (out / "logs" / "sft").iterdir()} == {"rank_0.log", "rank_1.log"}
    assert "final model written" in (out / "logs" / "sft" / "rank_0.log").read_text()
    shards = sorted(p.name for p in (out / "checkpoints" / "step_4" / "state").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    final = load_file(out / "model" / "model.safetensors")

    # One process loads the 2-process checkpoint: its weights are the ones the run ended with.
    from prime_core.config.checks import section_model
    from prime_core.distributed import World, shutdown
    from prime_core.plugins import get_plugin_manager
    from prime_core.trainer import ckpt
    from prime_core.trainer.build import build_policy, full_state_dict
    from prime_core.trainer.config import OptimConfig
    from prime_core.trainer.optim import build_optimizer

    world = World(device=torch.device("cpu"))
    try:
        policy = build_policy(section_model("trainer", "model")(name=str(tiny), impl="hf", dtype="float32"),
                              get_plugin_manager(), world)
        assert policy.applied == []  # one float32 process: FSDP would have nothing to do
        optimizer = build_optimizer(policy.model, OptimConfig())
        assert ckpt.load(out / "checkpoints" / "step_4", policy.model, optimizer)["world_size"] == 2
        state = full_state_dict(policy, world)
    finally:
        shutdown()
    for key, value in final.items():
        assert torch.equal(state[key], value), key
    assert optimizer.state, "the optimizer state came back too"


def test_a_stray_rank_in_the_environment_is_refused(tiny, tmp_path):
    """RANK left in the shell would make a lone trainer no rank 0: it would train without
    publishing or logging, and its run would wait forever. It stops at once, saying so."""
    data = tmp_path / "d.jsonl"
    chat = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]
    data.write_text(json.dumps({"messages": chat}) + "\n")
    result = subprocess.run([sys.executable, "-m", "prime_core", "sft", "--model.name", str(tiny), "--data.path",
                             str(data), "--output-dir", str(tmp_path / "sft"), "--max-steps", "1"],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "RANK": "32"})
    assert result.returncode != 0
    assert "RANK=32 but WORLD_SIZE=1" in result.stderr and "unset RANK" in result.stderr, result.stderr
