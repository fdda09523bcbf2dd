"""`prime report`: the PNG and the summary from metrics.jsonl records as the roles write them."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from prime_core.metrics import METRICS_FILE, append_jsonl, flatten

pytest_plugins = ["prime_core.testing"]


def fake_run(folder: Path, steps: int, seed: int) -> Path:
    """The records an RL run writes (trainer, orchestrator, eval every 5 steps), through the same
    flattening and writer as ``MetricsLogger``."""
    rng = random.Random(seed)
    folder.mkdir(parents=True)
    path = folder / METRICS_FILE
    for step in range(1, steps + 1):
        append_jsonl(path, {"step": step, "role": "orchestrator", **flatten({
            "reward": 0.5 + step / (2 * steps) + rng.uniform(-0.05, 0.05), "off_policy_mean": rng.uniform(0, 1),
            "off_policy_max": 1, "sample_tokens_per_s": rng.uniform(900, 1100),
            "env_rewards": {"arithmetic": rng.random()}})})
        append_jsonl(path, {"step": step, "role": "trainer", "loss": rng.uniform(-0.1, 0.1),
                            "entropy": 2 - step / steps, "mismatch_kl": rng.uniform(0, 1e-3),
                            "grad_norm": rng.uniform(0.1, 1), "tokens_per_s": rng.uniform(4000, 5000)})
        if step % 5 == 0:
            append_jsonl(path, {"step": step, "role": "eval", **flatten(
                {"arithmetic": {"avg@4": step / steps, "pass@1": step / steps, "pass@2": 0.9, "pass@4": 1.0}})})
    return folder


def test_two_runs_overlaid_into_one_png_and_a_summary(prime_cli, installed_plugins, tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    a, b = fake_run(tmp_path / "a", 20, 0), fake_run(tmp_path / "b", 12, 1)
    result = prime_cli("report", str(a), str(b), "--out", str(tmp_path / "cmp.png"))
    assert result.exit_code == 0, result.output
    image = imread(tmp_path / "cmp.png")
    assert image.shape[:2] == (935, 2200)
    # every panel has something drawn in it (a blank panel is almost all white)
    height, width = image.shape[0] // 2, image.shape[1] // 4
    for row in range(2):
        for col in range(4):
            cell = image[row * height + 60:(row + 1) * height - 60, col * width + 60:(col + 1) * width - 20, :3]
            assert (cell.mean(axis=2) < 0.9).mean() > 0.01, (row, col)
    text = result.output
    assert "a (" in text and "steps 1..20, roles eval, orchestrator, trainer" in text
    from prime_core.metrics import read_jsonl

    rewards = [r["reward"] for r in read_jsonl(a / METRICS_FILE) if r["role"] == "orchestrator"]
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("reward ") and "first" not in ln)
    assert line.split()[1:4] == ["20", f"{rewards[0]:.4g}", f"{rewards[-1]:.4g}"]
    assert "eval pass@k: arithmetic/pass@1" in text and "arithmetic/pass@4" in text
    assert "arithmetic/pass@2" not in text, "pass@1 and the largest k only"


def test_default_png_next_to_the_run_and_clear_errors(prime_cli, installed_plugins, tmp_path):
    run = fake_run(tmp_path / "run", 3, 0)
    result = prime_cli("report", str(run))
    assert result.exit_code == 0 and (run / "report.png").is_file(), result.output
    empty = tmp_path / "empty"
    empty.mkdir()
    result = prime_cli("report", str(empty))
    assert result.exit_code != 0 and f"{empty}: no metrics.jsonl" in result.output
    result = prime_cli("report", str(run), "--label", "x", "--label", "y", "--no-plot")
    assert result.exit_code != 0 and "--label was given 2 times for 1 runs" in result.output
