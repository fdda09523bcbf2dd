"""Step batch files (``prime_core.orchestrator.batch_format``): both formats give back exactly
what was packed, a damaged file is refused with its name, the trainer trains the same on either,
and the format benchmark runs (``--tiny``)."""

from __future__ import annotations

import copy
import json
import random
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from prime_core.errors import PrimeError
from prime_core.orchestrator.batch import (
    TrainingSample,
    batch_file,
    pack,
    read_batch,
    remove_batches_from,
    rollout_dir,
    wait_for_batch,
    write_batch,
)
from prime_core.orchestrator.batch_format import ARRAYS, FORMATS, OPTIONAL

ROOT = Path(__file__).resolve().parents[1]


def random_samples(rng: random.Random, count: int, vocab: int = 151_936) -> list[TrainingSample]:
    """Samples of random lengths, ids, log-probabilities (float32 values, as vLLM gives them)
    and advantages; every other one multi-turn, with environment turns masked out."""
    samples = []
    for i in range(count):
        n_prompt, n_completion = rng.randint(1, 40), rng.randint(1, 60)
        mask = None
        if i % 2:
            mask = [1] * n_completion
            for _ in range(rng.randint(1, 3)):
                start = rng.randrange(n_completion)
                end = min(n_completion, start + rng.randint(1, 10))
                mask[start:end] = [0] * (end - start)
        logprobs = np.float32([-rng.expovariate(1.0) for _ in range(n_completion)]).tolist()
        samples.append(TrainingSample([rng.randrange(vocab) for _ in range(n_prompt)],
                                      [rng.randrange(vocab) for _ in range(n_completion)], logprobs,
                                      rng.uniform(-2, 2), rng.random(), rng.randrange(5), "env", mask))
    return samples


@pytest.fixture
def rng():
    seed = random.SystemRandom().randrange(2**32)
    print(f"seed {seed}")  # shown when a test fails: rerun with it
    return random.Random(seed)


def expected(row) -> dict:
    dtypes = {**ARRAYS, **OPTIONAL}
    return {f.name: np.asarray(getattr(row, f.name), dtype=dtypes[f.name]) for f in fields(row)
            if getattr(row, f.name) is not None}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_batch_reads_back_exactly_as_packed(fmt, rng, tmp_path):
    samples = random_samples(rng, 40)
    assert sum(0 in (s.completion_mask or []) for s in samples) == 20, "half of them multi-turn"
    rows = pack(samples, seq_len=64)  # some are cut at seq_len
    info = {"reward": rng.random(), "versions": [1, 2], "off_policy_max": 1}
    path = write_batch(tmp_path, 5, rows, temperature=0.7, info=info, format=fmt)
    assert path == rollout_dir(tmp_path, 5) / FORMATS[fmt].filename and batch_file(tmp_path, 5) == path
    assert [p.name for p in path.parent.iterdir()] == [path.name], "no temporary file left"
    batch = wait_for_batch(tmp_path, 5, timeout=1)
    assert (batch["step"], batch["temperature"], batch["info"]) == (5, 0.7, info)
    assert len(batch["micro_batches"]) == len(rows)
    for got, row in zip(batch["micro_batches"], rows, strict=True):
        want = expected(row)
        assert set(got) == set(want)
        for key in want:
            assert got[key].dtype == want[key].dtype and np.array_equal(got[key], want[key]), key
        # the multi-turn masks: trained exactly where the policy sampled, advantages only there
        assert np.array_equal(got["advantages"] != 0, (got["loss_mask"] == 1) & (want["advantages"] != 0))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_teacher_logprobs_and_the_training_mode_round_trip(fmt, rng, tmp_path):
    samples = random_samples(rng, 30)
    for sample in samples[::3]:  # a teacher scored a third of them: rows with and rows without
        sample.teacher_logprobs = np.float32([-rng.expovariate(1.0) for _ in sample.completion_ids]).tolist()
    rows = pack(samples, seq_len=128)
    assert any(r.teacher_logprobs is None for r in rows) and any(r.teacher_logprobs is not None for r in rows)
    batch = read_batch(write_batch(tmp_path, 2, rows, temperature=1.0, info={}, training_mode="opd", format=fmt))
    assert batch["training_mode"] == "opd"
    for got, row in zip(batch["micro_batches"], rows, strict=True):
        want = expected(row)
        assert set(got) == set(want), "teacher_logprobs exactly on the rows that have them"
        for key in want:
            assert got[key].dtype == want[key].dtype and np.array_equal(got[key], want[key]), key


def test_both_formats_read_the_same(rng, tmp_path):
    rows = pack(random_samples(rng, 30), seq_len=256)
    a = read_batch(write_batch(tmp_path / "a", 1, rows, temperature=1.0, info={}, format="binary"))
    b = read_batch(write_batch(tmp_path / "b", 1, rows, temperature=1.0, info={}, format="json"))
    for x, y in zip(a["micro_batches"], b["micro_batches"], strict=True):
        assert all(np.array_equal(x[k], y[k]) and x[k].dtype == y[k].dtype for k in ARRAYS)


def test_position_ids_of_another_kind_are_kept_as_they_are(rng, tmp_path):
    """``pack``'s position ids are stored as the samples' lengths; any others (a row that
    continues a sample, positions that do not count by one) verbatim."""
    from safetensors.numpy import load

    packed = [{f.name: getattr(r, f.name) for f in fields(r)} for r in pack(random_samples(rng, 6), seq_len=64)]
    odd = [dict(packed[0], position_ids=[p + 3 for p in packed[0]["position_ids"]]),
           dict(packed[-1], position_ids=[2 * p for p in packed[-1]["position_ids"]])]
    for rows, stored in ((packed, "sample_lengths"), (odd, "position_ids")):
        path = write_batch(tmp_path / stored, 1, rows, temperature=1.0, info={}, format="binary")
        assert stored in load(path.read_bytes())
        for got, row in zip(read_batch(path)["micro_batches"], rows, strict=True):
            assert got["position_ids"].dtype == np.int32 and got["position_ids"].tolist() == row["position_ids"]


def test_an_empty_batch_round_trips(tmp_path):
    for fmt in FORMATS:
        batch = read_batch(write_batch(tmp_path / fmt, 1, [], temperature=1.0, info={}, format=fmt))
        assert batch["micro_batches"] == []


def test_the_binary_file_is_several_times_smaller_than_json(rng, tmp_path):
    rows = pack(random_samples(rng, 40), seq_len=256)
    sizes = {fmt: write_batch(tmp_path / fmt, 1, rows, temperature=1.0, info={}, format=fmt).stat().st_size
             for fmt in FORMATS}
    assert sizes["json"] > 2 * sizes["binary"]


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "cut":
        path.write_bytes(data[:len(data) * 2 // 3])
    elif how == "cut-header":
        path.write_bytes(data[:6])
    elif how == "flip":
        data[-20] ^= 0xFF  # in the last array's data, past the header
        path.write_bytes(bytes(data))
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "other":
        path.write_bytes(b'{"hello": "world"}' if path.suffix == ".json" else b"\x08" + b"\0" * 7 + b'{"a": 1}')


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("how", ["cut", "cut-header", "flip", "empty", "other"])
def test_a_damaged_file_is_refused_naming_it(fmt, how, rng, tmp_path):
    if fmt == "json" and how == "flip":
        pytest.skip("JSON text has no checksum: a changed digit is still a number")
    rows = pack(random_samples(rng, 8), seq_len=128)
    path = write_batch(tmp_path, 3, rows, temperature=1.0, info={}, format=fmt)
    _damage(path, how)
    with pytest.raises(PrimeError, match=rf"cannot read the batch {path}: ") as info:
        wait_for_batch(tmp_path, 3, timeout=1)
    assert "--resume" in info.value.hint


def test_a_binary_file_of_another_layout_is_refused(tmp_path):
    from safetensors.numpy import save

    path = rollout_dir(tmp_path, 1) / "batch.safetensors"
    path.parent.mkdir(parents=True)
    path.write_bytes(save({"input_ids": np.zeros(3, np.int32)}))
    with pytest.raises(PrimeError, match="without prime's step-batch header"):
        read_batch(path)


def test_writing_one_format_drops_the_other_and_resume_removes_later_batches(rng, tmp_path):
    rows = pack(random_samples(rng, 4), seq_len=128)
    write_batch(tmp_path, 1, rows, temperature=1.0, info={}, format="json")
    write_batch(tmp_path, 1, rows, temperature=1.0, info={}, format="binary")
    assert [p.name for p in rollout_dir(tmp_path, 1).iterdir()] == ["batch.safetensors"]
    for step, fmt in ((2, "json"), (3, "binary"), (4, "json")):
        write_batch(tmp_path, step, rows, temperature=1.0, info={}, format=fmt)
    remove_batches_from(tmp_path, 3)
    assert [batch_file(tmp_path, s) is not None for s in (1, 2, 3, 4)] == [True, True, False, False]
    with pytest.raises(PrimeError, match=r"waited 0.2 s for the batch of step 3: the orchestrator has not written "
                                         r".*rollouts/step_3/batch.safetensors \(or batch.json\)"):
        wait_for_batch(tmp_path, 3, timeout=0.2)


def test_a_json_batch_of_the_earlier_layout_still_reads(tmp_path):
    """Before binary batches, the orchestrator wrote this JSON (lists of Python numbers)."""
    rows = [{"input_ids": [1, 2, 3], "position_ids": [0, 1, 2], "loss_mask": [0, 1, 1],
             "advantages": [0.0, 0.5, 0.5], "inference_logprobs": [0.0, -0.25, -1.5]}]
    path = rollout_dir(tmp_path, 2) / "batch.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"step": 2, "temperature": 1.0, "info": {"reward": 1.0}, "micro_batches": rows}))
    (row,) = wait_for_batch(tmp_path, 2, timeout=1)["micro_batches"]
    assert row["loss_mask"].dtype == np.uint8 and row["inference_logprobs"].tolist() == [0.0, -0.25, -1.5]


def test_the_trainer_step_trains_the_same_on_either_format(rng, tmp_path):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from prime_core.algorithms import default_loss
    from prime_core.distributed import World
    from prime_core.trainer.step import train_step

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    samples = random_samples(rng, 12, vocab=64)
    for s in samples:  # log-probabilities near the model's, as sampled from it
        s.completion_logprobs = [lp + rng.uniform(-0.1, 0.1) for lp in s.completion_logprobs]
    rows = pack(samples, seq_len=96)

    def trained(batch_rows):
        policy = SimpleNamespace(model=copy.deepcopy(model), before_step=[], before_backward=[], update=None)
        optimizer = torch.optim.AdamW(policy.model.parameters(), lr=1e-2)
        training = SimpleNamespace(world=World(), policy=policy, optimizer=optimizer, pass_tokens=2048,
                                   scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0))
        sums = train_step(training, batch_rows, max_norm=1.0, loss_fn=default_loss)
        sums.pop("rows")
        return sums, policy.model.state_dict()

    lists = [{f.name: getattr(r, f.name) for f in fields(r)} for r in rows]  # what the trainer got before
    results = {"lists": trained(lists)}
    for fmt in FORMATS:
        path = write_batch(tmp_path / fmt, 1, rows, temperature=1.0, info={}, format=fmt)
        results[fmt] = trained(read_batch(path)["micro_batches"])
    want_sums, want_state = results["lists"]
    assert want_sums["loss_tokens"] == sum(sum(r.loss_mask) for r in rows) > 0
    for fmt in FORMATS:
        sums, state = results[fmt]
        assert sums == want_sums, fmt
        assert all(torch.equal(state[k], want_state[k]) for k in want_state), fmt
    assert not all(torch.equal(v, model.state_dict()[k]) for k, v in want_state.items()), "the step changed weights"


def test_the_format_benchmark_runs_tiny(tmp_path):
    out = tmp_path / "r.jsonl"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "batch_format_bench.py"), "--tiny",
                             "--work", str(tmp_path / "work"), "--out", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["format"] for r in lines] == ["json", "binary"]
    assert all(r["bytes"] > 0 and r["write_s"] > 0 and r["read_s"] > 0 for r in lines)
    assert lines[1]["smaller_vs_json"] > 2 and "binary vs json:" in result.stdout
