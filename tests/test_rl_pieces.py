"""The RL building blocks that need no server: packing, the attention mask of packed rows,
advantages, the loss, a trainer step, checkpoints, weights and metrics files."""

import json
import math

import pytest
import torch

from prime_core.algorithms import default_loss, grpo_advantages
from prime_core.errors import PrimeError
from prime_core.metrics import append_jsonl, drop_steps_from, read_jsonl
from prime_core.orchestrator.batch import TrainingSample, pack, wait_for_batch, write_batch
from prime_core.trainer.model import block_causal_mask, token_logprobs


def sample(n_prompt, n_completion, adv=1.0, version=0):
    return TrainingSample(list(range(1, n_prompt + 1)), list(range(100, 100 + n_completion)),
                          [-0.5] * n_completion, adv, 0.0, version)


def test_pack_first_fit_decreasing_keeps_every_token():
    samples = [sample(3, 4), sample(2, 2), sample(5, 5), sample(1, 1)]
    rows = pack(samples, seq_len=12)
    assert all(len(r) <= 12 for r in rows)
    assert sum(len(r) for r in rows) == sum(len(s) for s in samples)
    assert sum(sum(r.loss_mask) for r in rows) == 4 + 2 + 5 + 1
    assert sum(row.position_ids.count(0) for row in rows) == len(samples), "each sample starts at position 0"
    for row in rows:
        for t, m in enumerate(row.loss_mask):
            assert (row.inference_logprobs[t] == -0.5) == bool(m)


def test_pack_cuts_overlong_samples():
    (row,) = pack([sample(4, 20)], seq_len=10)
    assert len(row) == 10 and sum(row.loss_mask) == 6


def test_block_mask_matches_separate_forwards():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)).eval()
    a, b = torch.randint(0, 64, (1, 5)), torch.randint(0, 64, (1, 4))
    packed = torch.cat([a, b], 1)
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3]])
    mask = block_causal_mask(positions)
    assert mask.shape == (1, 1, 9, 9) and not mask[0, 0, 5, :5].any() and mask[0, 0, 4, :5].all()
    with torch.no_grad():
        lp, ent = token_logprobs(model, packed, positions)
        lpa, _ = token_logprobs(model, a, torch.arange(5)[None])
        lpb, _ = token_logprobs(model, b, torch.arange(4)[None])
    assert torch.allclose(lp[:5], lpa, atol=1e-5)
    assert torch.allclose(lp[6:], lpb[1:], atol=1e-5), "the second sample must not see the first"
    assert (ent[1:] > 0).all()


def test_grpo_advantages_are_centred():
    assert grpo_advantages([1.0, 0.0, 0.0, 1.0]) == [0.5, -0.5, -0.5, 0.5]
    assert grpo_advantages([0.3, 0.3]) == [0.0, 0.0]


def test_default_loss_on_policy_is_the_policy_gradient():
    logp = torch.log(torch.tensor([0.5, 0.2, 0.9])).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 0.5])
    loss, extra = default_loss(logp, logp.detach(), adv)
    loss.sum().backward()
    assert torch.allclose(logp.grad, -adv, atol=1e-6), "on-policy: d(loss)/d(logp) = -A"
    assert torch.allclose(extra["mismatch_kl"], torch.zeros(3), atol=1e-7)


def test_default_loss_masks_tokens_that_moved_too_far():
    inference = torch.log(torch.tensor([0.1, 0.9, 0.5, 0.5]))
    trainer = torch.log(torch.tensor([0.5, 0.5, 0.55, 0.45]))  # Δp = +0.4, -0.4, +0.05, -0.05
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    _, extra = default_loss(trainer, inference, adv)
    assert extra["is_masked"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert (extra["mismatch_kl"] >= 0).all()


def test_train_step_reduces_loss_on_a_fixed_batch(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from prime_core.distributed import World
    from prime_core.trainer.step import forward_backward

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    good = TrainingSample([1, 2, 3], [7, 8], [0.0, 0.0], 1.0, 1.0, 0)
    bad = TrainingSample([1, 2, 3], [9, 10], [0.0, 0.0], -1.0, 0.0, 0)
    with torch.no_grad():
        for s in (good, bad):
            lp, _ = token_logprobs(model, torch.tensor([s.prompt_ids + s.completion_ids]), torch.arange(5)[None])
            s.completion_logprobs = lp[3:].tolist()
    rows = pack([good, bad], seq_len=64)
    batch = {"temperature": 1.0, "micro_batches": [vars(r) for r in rows]}
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    from prime_core.algorithms import default_loss

    def prob(s):
        with torch.no_grad():
            lp, _ = token_logprobs(model, torch.tensor([s.prompt_ids + s.completion_ids]), torch.arange(5)[None])
        return float(lp[3:].sum().exp())

    before = prob(good), prob(bad)
    rows = batch["micro_batches"]
    sums = forward_backward(model, rows, total_loss_tokens=sum(sum(r["loss_mask"]) for r in rows), world=World(),
                            loss_fn=default_loss)
    opt.step()
    after = prob(good), prob(bad)
    assert after[0] > before[0] and after[1] < before[1], "positive advantage up, negative down"
    assert sums["tokens"] == 10 and math.isfinite(sums["loss"])

    # Applied.before_backward: told before each backward pass whether it is the step's last.
    heard = []
    rows = [vars(r) for r in pack([good, bad, good], seq_len=5)]
    forward_backward(model, rows, total_loss_tokens=sum(sum(r["loss_mask"]) for r in rows), world=World(),
                     loss_fn=default_loss, before_backward=[lambda m, last: heard.append((m is model, last))])
    assert heard == [(True, False), (True, False), (True, True)]


def test_batches_are_written_atomically_and_awaited(tmp_path):
    rows = pack([sample(2, 3)], 16)
    write_batch(tmp_path, 3, rows, temperature=0.7, info={"reward": 0.5})
    batch = wait_for_batch(tmp_path, 3, timeout=1)
    assert batch["temperature"] == 0.7 and batch["micro_batches"][0]["input_ids"].tolist() == rows[0].input_ids
    assert not list((tmp_path / "rollouts" / "step_3").glob("*.tmp"))
    with pytest.raises(PrimeError, match=r"waited 0.2 s for the batch of step 4: the orchestrator has not written "
                       r".*rollouts/step_4/batch.safetensors"):
        wait_for_batch(tmp_path, 4, timeout=0.2)


def test_checkpoints_and_weights_round_trip(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from prime_core.trainer import ckpt
    from prime_core.weights import FilesystemLoader, FilesystemPublisher

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    ckpt.save(tmp_path, 2, model, opt, {"note": "x"})
    (tmp_path / "checkpoints" / "step_4").mkdir()  # an interrupted save: no marker
    assert ckpt.latest_step(tmp_path) == 2
    other = Qwen3ForCausalLM(config)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    assert ckpt.load(tmp_path / "checkpoints" / "step_2", other, other_opt)["note"] == "x"
    for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert other_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]

    publisher = FilesystemPublisher(output_dir=tmp_path, keep=2)
    loader = FilesystemLoader(output_dir=tmp_path)
    assert loader.latest() is None
    for step in (1, 2, 3):
        publisher.publish(model, step)
    assert loader.latest()[0] == 3
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["step_2", "step_3"]


def test_checkpoints_and_weights_record_the_plugins_that_made_them(tmp_path, plugin_manager):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from prime_core.trainer import ckpt
    from prime_core.weights import PLUGINS_FILE, FilesystemPublisher

    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    ckpt.save(tmp_path, 1, model, torch.optim.SGD(model.parameters(), lr=0.1), {})
    path = tmp_path / "checkpoints" / "step_1"
    versions = plugin_manager.versions()
    assert json.loads((path / "progress.json").read_text())["plugins"] == versions and "prime-core" in versions
    assert ckpt.plugin_changes(path) == []
    published = FilesystemPublisher(output_dir=tmp_path).publish(model, 1)
    assert json.loads((published / PLUGINS_FILE).read_text()) == versions

    progress = json.loads((path / "progress.json").read_text())
    progress["plugins"] = {**versions, "prime-core": "0.0.1", "prime-plugin-gone": "1.0"}
    (path / "progress.json").write_text(json.dumps(progress))
    assert ckpt.plugin_changes(path) == [f"prime-core 0.0.1 -> {versions['prime-core']}",
                                         "prime-plugin-gone 1.0 is no longer active"]


def test_metrics_resume_moves_redone_steps_aside(tmp_path):
    path = tmp_path / "metrics.jsonl"
    for step in (1, 2, 3, 4):
        append_jsonl(path, {"step": step, "role": "trainer"})
        append_jsonl(path, {"step": step, "role": "orchestrator"})
    assert drop_steps_from(path, "trainer", 3) == 2
    steps = [(r["role"], r["step"]) for r in read_jsonl(path)]
    assert ("trainer", 3) not in steps and ("orchestrator", 4) in steps and ("trainer", 2) in steps
    moved = [json.loads(line) for line in (tmp_path / "metrics.superseded.jsonl").read_text().splitlines()]
    assert [r["step"] for r in moved] == [3, 4]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_token_logprobs_match_log_softmax(temperature, monkeypatch):
    """Log-probabilities, entropies and gradients of the chunked function equal those of a
    full float64 log-softmax (chunks of 64 rows here, so several chunks are exercised)."""
    import torch

    from prime_core.trainer import model as model_module

    monkeypatch.setattr(model_module, "CHUNK_ELEMENTS", 64 * 4096)
    torch.manual_seed(0)
    logits = torch.randn(300, 4096, dtype=torch.float32, requires_grad=True)
    targets = torch.randint(0, 4096, (300,))
    weights = torch.randn(300)
    logp, entropy = model_module.token_logprob_fn()(logits, targets, temperature, True)
    (logp * weights).sum().backward()
    leaf = logits.detach().double().requires_grad_()
    x = leaf / temperature
    reference = x.log_softmax(-1).gather(-1, targets[:, None])[:, 0]
    (reference * weights.double()).sum().backward()
    assert torch.allclose(logp.double(), reference, atol=1e-5)
    assert torch.allclose(entropy.double(), -(x.softmax(-1) * x.log_softmax(-1)).sum(-1), atol=1e-4)
    assert entropy.requires_grad is False
    assert torch.allclose(logits.grad.double(), leaf.grad, atol=1e-6)


def test_rows_are_shared_by_tokens_and_padded_to_equal_counts():
    from prime_core.trainer.step import share

    rows = [{"input_ids": [0] * n, "loss_mask": [1] * n} for n in (100, 90, 60, 40, 10)]
    shares = [share(rows, rank, 2) for rank in range(2)]
    real = [[r for r in s if not r.get("padding")] for s in shares]
    assert sorted(len(r["input_ids"]) for s in real for r in s) == [10, 40, 60, 90, 100]  # every row once
    loads = [sum(len(r["input_ids"]) for r in s) for s in real]
    assert abs(loads[0] - loads[1]) <= 20, loads
    assert len(shares[0]) == len(shares[1]), "every rank runs as many passes"
    three = [share(rows[:2], rank, 3) for rank in range(3)]
    assert [len(s) for s in three] == [1, 1, 1] and three[2][0]["padding"] and sum(three[2][0]["loss_mask"]) == 0
    assert share(rows, 0, 1) == rows


def test_weights_are_published_in_the_background_as_snapshots_of_their_step(tmp_path, monkeypatch):
    """The filesystem transport writes version N in a thread while step N+1 trains: each
    version on disk holds the weights of its own step, exactly as a trainer that publishes in
    place writes them (not those of a later step, as a writer reading the live parameters
    would: the Hugging Face model on a CPU hands out its own parameters), and the last is on disk
    when the trainer returns."""
    import threading
    import time

    import torch
    from safetensors.torch import load_file

    from prime_core.cli.common import load_config
    from prime_core.trainer import role
    from prime_core.weights import MARKER, FilesystemPublisher
    from prime_plugin_hf.tiny import build_tiny

    model = build_tiny(tmp_path / "model", hidden_size=64, num_layers=2, dtype="float32")
    threads: dict[int, str] = {}
    original_publish, original_init = FilesystemPublisher.publish, role.Publishing.__init__

    def slow_publish(self, model, step, state_dict=None):
        threads[step] = threading.current_thread().name
        time.sleep(1.0)  # the next step trains meanwhile
        return original_publish(self, model, step, state_dict)

    def in_place(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.background = False

    def train(out, background: bool) -> dict[int, dict]:
        threads.clear()
        with monkeypatch.context() as patch:
            patch.setattr(FilesystemPublisher, "publish", slow_publish)
            if not background:
                patch.setattr(role.Publishing, "__init__", in_place)
            config = load_config("trainer", ["--model.name", str(model), "--output-dir", str(out), "--max-steps",
                                             "3", "--seq-len", "64", "--data.fake.batch-size", "2", "--optim.lr",
                                             "1e-2", "--model.impl", "hf"])
            assert role.run(config) == 0
        assert all((out / "weights" / f"step_{s}" / MARKER).exists() for s in (1, 2, 3))
        return {s: load_file(str(out / "weights" / f"step_{s}" / "model.safetensors")) for s in (1, 2, 3)}

    reference = train(tmp_path / "in_place", background=False)
    assert set(threads.values()) == {"MainThread"}
    written = train(tmp_path / "background", background=True)
    assert threads == {1: "prime-publish-1", 2: "prime-publish-2", 3: "prime-publish-3"}
    for step in (1, 2, 3):
        for key, tensor in reference[step].items():
            assert torch.equal(written[step][key], tensor), f"step {step}: {key} is not the weights of its step"
    key = next(k for k in written[1] if k.endswith("q_proj.weight"))
    assert not torch.equal(written[1][key], written[3][key])


def test_rows_stacked_into_one_pass_give_one_row_at_a_time_s_loss_and_gradients():
    """Rows of different lengths (several samples each, a padding row without the teacher's
    values the others carry), in float64, with and without the RL loss: stacked three to a
    pass, or re-packed into rows as long as the longest sample, the sums and every gradient
    are those of one row per pass; the tokens counted are the real ones, not the padding."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from prime_core.distributed import World
    from prime_core.trainer.step import forward_backward, padding_row, repacked

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)).double()
    generator = torch.Generator().manual_seed(1)

    def row(*lengths: int, teacher: bool = True) -> dict:
        n = sum(lengths)
        out = {"input_ids": torch.randint(1, 64, (n,), generator=generator).tolist(),
               "position_ids": [p for length in lengths for p in range(length)],
               # a sample's first token is prompt: nothing predicts it (across a boundary) in the loss
               "loss_mask": [int(bool(p) and float(torch.rand(1, generator=generator)) < 0.7)
                             for length in lengths for p in range(length)],
               "advantages": torch.randn(n, generator=generator).tolist(),
               "inference_logprobs": (-torch.rand(n, generator=generator) * 3).tolist()}
        if teacher:
            out["teacher_logprobs"] = (-torch.rand(n, generator=generator) * 3).tolist()
        return out

    rows = [row(5, 9, 3), row(11), row(4, 4), padding_row(), row(2, 6, 7, 1), row(13)]
    total = sum(sum(r["loss_mask"]) for r in rows)

    def run(rows, rows_per_pass: int, loss_fn):
        model.zero_grad()
        sums = forward_backward(model, rows, total_loss_tokens=total, world=World(), loss_fn=loss_fn,
                                rows_per_pass=rows_per_pass)
        return sums, {name: p.grad.clone() for name, p in model.named_parameters()}

    shorter = repacked(rows)  # 11 samples into rows of 13, the longest
    assert len(shorter) == 5 and {len(r["input_ids"]) for r in shorter} == {13}
    for loss_fn in (None, default_loss):
        one, one_grads = run(rows, 1, loss_fn)
        assert one["tokens"] == sum(len(r["input_ids"]) for r in rows) - 2
        assert loss_fn is None or one["teacher_kl"] != 0
        for sums, grads in (run(rows, 3, loss_fn), run(shorter, 4, loss_fn)):
            assert sums["tokens"] == one["tokens"]
            for key in one:  # the sums are read in float32
                assert sums[key] == pytest.approx(one[key], rel=1e-6, abs=1e-9), key
            for name, grad in one_grads.items():
                torch.testing.assert_close(grads[name], grad, rtol=1e-10, atol=1e-12, msg=name)


def test_rows_per_pass_fills_pass_tokens_only_where_rows_can_be_stacked():
    from types import SimpleNamespace

    from prime_core.trainer.step import rows_per_pass

    plain = SimpleNamespace()
    assert rows_per_pass(plain, 256, 2048, 1) == 8
    assert rows_per_pass(plain, 300, 2048, 1) == 6
    assert rows_per_pass(plain, 4096, 2048, 1) == 1
    assert rows_per_pass(plain, 256, 2048, 2) == 1  # context parallelism splits each row
    assert rows_per_pass(SimpleNamespace(accepts_packing=True), 256, 2048, 1) == 1  # one packed row, varlen
    assert rows_per_pass(SimpleNamespace(lm_head_fn=print), 256, 2048, 1) == 1  # the fused head takes one row


@pytest.mark.parametrize("cp", [1, 2])
def test_a_row_carries_its_sample_starts_from_the_host(cp):
    """``prediction_tensors`` builds the row on the host: its packing's starts (read by attention
    without a device sync) are the boundaries of its segment ids, the CP padding a sample of its
    own, and the targets and values are shifted one position as before."""
    from prime_core.trainer.packing import Packing
    from prime_core.trainer.step import prediction_tensors

    positions = [0, 1, 2, 0, 1, 0, 1, 2, 3]  # 9 tokens: cp 2 pads to 12
    row = {"input_ids": list(range(10, 19)), "position_ids": positions, "loss_mask": [1.0] * 9,
           "advantages": [0.5] * 9, "inference_logprobs": [float(-i) for i in range(9)]}
    tensors, packing = prediction_tensors(row, "cpu", 0, cp)
    full = positions + list(range(12 - 9)) if cp == 2 else positions
    expected = Packing.from_position_ids(torch.tensor(full))
    assert packing.starts == (0, 3, 5, 9)[: 4 if cp == 2 else 3]
    assert packing.length == len(full)
    assert list(packing.starts) == [start for start, _ in expected.segments()]
    assert torch.equal(packing.segment_ids, expected.segment_ids[packing.index])
    if cp == 1:
        assert tensors["targets"].tolist() == list(range(11, 19)) + [10]
        assert tensors["inference_logprobs"].tolist() == [float(-i) for i in range(1, 9)] + [0.0]
