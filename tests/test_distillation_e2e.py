"""On-policy distillation end to end on this CPU machine: ``prime run`` with
``training_mode = "opd"`` starts the student's vLLM server, the trainer, the orchestrator and a
second vLLM server for the teacher (``teacher_inference``, placed after the trainer). Two tiny
models of the same tokenizer, different weights; a few steps."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prime_core.orchestrator.batch import batch_file, read_batch
from prime_core.testing import free_ports

pytestmark = [
    pytest.mark.slow,
    pytest.mark.serial,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (scripts/install.sh)"),
]

CONFIG = """
max_steps = {steps}
seq_len = 256

[model]
name = "{student}"

[trainer.model]
impl = "hf"
dtype = "float32"

[trainer.optim]
lr = 2e-3
weight_decay = 0.0

[orchestrator]
training_mode = "opd"
batch_size = 16
rollouts_per_example = 4

[orchestrator.sampling]
max_tokens = 8

[[orchestrator.env]]
id = "arithmetic"
args = {{ digits = 1 }}

[inference]
startup_timeout = 300

[inference.model]
dtype = "float32"
enforce_eager = true
max_model_len = 256

[inference.server]
port = {port}

[teacher_inference.model]
name = "{teacher}"
"""


def prime(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "prime_core", *args], capture_output=True, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=timeout)
    said = f"{result.stdout}\n{result.stderr}"
    assert result.returncode == 0, f"prime {' '.join(args)} exited {result.returncode}:\n{said}"
    return result


def reverse_kl(student: Path, teacher: Path, prompts: list[list[int]]) -> float:
    """Mean over prompts of KL(student || teacher) of the first reply token's distribution, over
    the whole vocabulary (what on-policy distillation lowers), from Hugging Face forwards."""
    import torch
    from transformers import AutoModelForCausalLM

    s = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32).eval()
    t = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    total = 0.0
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            ls, lt = s(x).logits[0, -1].log_softmax(-1), t(x).logits[0, -1].log_softmax(-1)
            total += float((ls.exp() * (ls - lt)).sum())
    return total / len(prompts)


def test_on_policy_distillation_with_a_vllm_teacher(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prime_plugin_hf.tiny import build_tiny

    # `prime model tiny --seed 0` and `--seed 1`, built here (a `prime` process takes ~5 s to start)
    student, teacher = build_tiny(tmp_path / "student", seed=0), build_tiny(tmp_path / "teacher", seed=1)
    steps, out = 6, tmp_path / "run"
    config = tmp_path / "opd.toml"
    config.write_text(CONFIG.format(steps=steps, student=student, teacher=teacher, port=free_ports(2)))
    prime("run", str(config), "--output-dir", str(out))

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    trainer = [r for r in records if r["role"] == "trainer"]
    orchestrator = [r for r in records if r["role"] == "orchestrator"]
    assert [r["step"] for r in trainer] == list(range(1, steps + 1))
    kl = [r.get("teacher_kl") for r in trainer]
    assert all(v is not None and math.isfinite(v) and v != 0 for v in kl), f"teacher_kl per step: {kl}"
    assert sum(r["time/teacher_logprobs"] for r in orchestrator) > 0
    log = (out / "logs" / "orchestrator.log").read_text()
    assert f"teacher: {teacher} at" in log and "scores the sampled tokens" in log
    plan = json.loads((out / "configs" / "plan.json").read_text())
    assert [row["role"] for row in plan["placement"]][-1] == "teacher_inference"

    # The teacher's numbers are its log-probabilities of the student's tokens: vLLM's prefill
    # against a Hugging Face forward of the teacher, on sampled tokens only (mask 1).
    batch = read_batch(batch_file(out, 1))
    assert batch["training_mode"] == "opd"
    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    row = {key: values.tolist() for key, values in batch["micro_batches"][0].items()}
    starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["input_ids"])]
    worst, scored = 0.0, 0
    for a, b in zip(starts, starts[1:], strict=False):
        with torch.no_grad():
            logp = model(torch.tensor([row["input_ids"][a:b]])).logits[0].log_softmax(-1)
        for j in range(a + 1, b):
            if row["loss_mask"][j]:
                scored += 1
                worst = max(worst, abs(float(logp[j - a - 1, row["input_ids"][j]]) - row["teacher_logprobs"][j]))
            else:
                assert row["teacher_logprobs"][j] == 0.0
    assert scored and worst < 1e-3, f"vLLM teacher vs Hugging Face teacher: {worst}"

    # It trains toward the teacher: the student's reverse KL to it falls, measured exactly.
    import random

    from prime_core.orchestrator.role import prompt_token_ids
    from prime_core.plugins import get_plugin_manager

    env = get_plugin_manager().select("environments", "arithmetic", key="env").load(digits=1)
    tokenizer = AutoTokenizer.from_pretrained(student)
    prompts = [prompt_token_ids(tokenizer, task.prompt) for task in env.tasks(random.Random(0), 40)]
    before = reverse_kl(student, teacher, prompts)
    after = reverse_kl(out / "weights" / f"step_{steps}", teacher, prompts)
    assert after < before, f"KL(student || teacher) did not fall: {before:.4f} -> {after:.4f}"
