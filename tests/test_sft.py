"""`prime sft`: chat JSONL with packed sequences, loss on the assistant turn only, a final
model that loads like any checkpoint, and clear errors for bad data."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("prime_plugin_hf", reason="the hf model plugin provides the model implementation")


def prime(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prime_core", *args], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from prime_plugin_hf.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("m") / "tiny", hidden_size=64, num_layers=1)


def test_chat_sample_masks_the_prompt(tiny):
    from transformers import AutoTokenizer

    from prime_core.sft.role import chat_sample

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    sample = chat_sample(tokenizer, [{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4"}])
    assert tokenizer.decode(sample.completion_ids) == "4<|im_end|>"
    assert tokenizer.decode(sample.prompt_ids).endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="assistant"):
        chat_sample(tokenizer, [{"role": "user", "content": "hi"}])


def test_sft_learns_a_small_dataset(tiny, tmp_path):
    data = tmp_path / "data.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"{a}+{b}"}, {"role": "assistant", "content": str(a + b)}]}
            for a in range(4) for b in range(4)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    result = prime("sft", "--model.name", str(tiny), "--model.dtype", "float32", "--data.path", str(data),
                   "--data.batch-size", "16", "--max-steps", "30", "--optim.lr", "3e-3", "--seq-len", "256",
                   "--output-dir", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    losses = [json.loads(line)["loss"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 30 and losses[-1] < 0.5 * losses[0], losses
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "model")
    AutoTokenizer.from_pretrained(tmp_path / "out" / "model")
    assert "prime-plugin-hf" in json.loads((tmp_path / "out" / "model" / "prime_plugins.json").read_text())


def test_bad_data_names_the_line(tiny, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]})
                    + "\n" + json.dumps({"text": "no messages"}) + "\n")
    result = prime("sft", "--model.name", str(tiny), "--data.path", str(data), "--output-dir", str(tmp_path / "o"))
    assert result.returncode == 2
    assert f"data.path: {data}, line 2" in result.stderr and "Traceback" not in result.stderr
    missing = prime("sft", "--model.name", str(tiny), "--data.path", str(tmp_path / "none.jsonl"))
    assert missing.returncode == 2 and "data.path" in missing.stderr and "file not found" in missing.stderr
