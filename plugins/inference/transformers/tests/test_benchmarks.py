"""The benchmarks of this backend run here with ``--tiny`` (a CPU, seconds per step): the
backends side by side, and the RL loop (asynchronous), each printing its table."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BENCHMARKS = Path(__file__).resolve().parents[4] / "benchmarks"


def bench(script: str, *args: str) -> str:
    result = subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True,
                            timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def test_backends_side_by_side_print_tokens_per_second(tmp_path):
    out = bench("inference_backends_bench.py", "--tiny", "--backends", "transformers", "--work", str(tmp_path),
                "--out", str(tmp_path / "r.jsonl"))
    rows = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [(r["backend"], r["concurrency"]) for r in rows] == [("transformers", 8), ("transformers", 16)]
    assert all(r["median_tokens_per_s"] > 0 and r["samples"] == r["concurrency"] for r in rows)
    assert "| concurrent samples | transformers tokens/s (median, best) |" in out


def test_the_rl_loop_is_measured(tmp_path):
    # One run, async_level = 1 (the bench runs 1 then 0 by default; the two differ in that one key,
    # and async_level = 0 runs end to end in tests/test_rl_e2e.py): a second run here cost 45 s.
    # 4 steps, not --tiny's 5 (`prime run`'s own --max-steps, after the bench's "--"): the start-up
    # step --tiny leaves out and three measured ones. Not fewer: async_level = 1 samples step 4
    # on policy 2 or newer, so the server loads a steady-state version whatever the timing (the
    # weight figures below); with 3 steps that load is a race.
    out = bench("transformers_rl_bench.py", "--tiny", "--async-levels", "1", "--out", str(tmp_path), "--",
                "--max-steps", "4")
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(r["run"], r["steps"], r["measured_steps"]) for r in results] == [("tiny-async1", 4, 3)]
    for r in results:
        for key in ("step_time", "train_time", "inference_time", "samples_per_s", "tokens_per_s", "weight_load_s",
                    "publish_to_served_s", "overlap_ratio"):
            assert math.isfinite(r[key]) and r[key] >= 0, (key, r)
        assert r["mismatch_kl_step1"] < 1e-3
    assert "| tiny-async1 |" in out
    # With a synchronous run beside it, the table ends with the two compared.
    spec = importlib.util.spec_from_file_location("transformers_rl_bench", BENCHMARKS / "transformers_rl_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sync = {**results[0], "run": "tiny-async0", "steps_per_hour": results[0]["steps_per_hour"] / 2}
    assert module.table([results[0], sync]).endswith(
        f"tiny: async {results[0]['steps_per_hour']:.0f} vs sync {sync['steps_per_hour']:.0f} steps/h = 2.00x")
