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
    # The exact expected reward of sampling the learned answers (examples/cpu reports it) rose
    # from chance: the probability of each answer through its end of turn.
    from prime_core.orchestrator.env import Task
    from prime_core.orchestrator.expected import expected_exact_match

    tasks = [Task(prompt=r["messages"][:1], answer=r["messages"][1]["content"]) for r in rows]
    before, after = expected_exact_match(tiny, tasks), expected_exact_match(tmp_path / "out" / "model", tasks)
    assert before < 1e-3 and after > 0.1, (before, after)  # 9e-6 -> 0.20 here


@pytest.mark.slow
def test_the_cpu_example_s_warm_up_reaches_its_reward(tmp_path):
    """``examples/cpu/sft.toml`` as ``examples/cpu/run.sh`` runs it (its model, data and 300
    steps): the expected reward on the 100 sums after SFT, which RL starts from. It is 0.73 here;
    a schedule change once left this recipe stalled at 0.07-0.11 with every other test passing."""
    from prime_plugin_hf.tiny import build_tiny

    root = Path(__file__).resolve().parents[1]
    # `prime model tiny BASE --hidden-size 128 --num-layers 2` is this call (the command's other
    # options at their defaults, the same seed): here, not in a process that imports torch again.
    build_tiny(tmp_path / "base", hidden_size=128, num_layers=2)
    for args in (("envs", "sft-data", "arithmetic", str(tmp_path / "sft.jsonl"), "--n", "8000", "--args",
                  '{"digits": 1}'),
                 ("sft", str(root / "examples" / "cpu" / "sft.toml"), "--output-dir", str(tmp_path / "sft"),
                  "--model.name", str(tmp_path / "base"), "--data.path", str(tmp_path / "sft.jsonl"))):
        result = prime(*args)
        assert result.returncode == 0, result.stderr
    from prime_core.orchestrator.env import Task
    from prime_core.orchestrator.expected import expected_exact_match
    from prime_plugin_tasks.arithmetic import SYSTEM

    sums = [Task(prompt=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{a}+{b}"}],
                 answer=str(a + b)) for a in range(10) for b in range(10)]
    assert expected_exact_match(tmp_path / "sft" / "model", sums) > 0.5


def test_bad_data_names_the_line(tiny, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]})
                    + "\n" + json.dumps({"text": "no messages"}) + "\n")
    result = prime("sft", "--model.name", str(tiny), "--data.path", str(data), "--output-dir", str(tmp_path / "o"))
    assert result.returncode == 2
    assert f"data.path: {data}, line 2" in result.stderr and "Traceback" not in result.stderr
    missing = prime("sft", "--model.name", str(tiny), "--data.path", str(tmp_path / "none.jsonl"))
    assert missing.returncode == 2 and "data.path" in missing.stderr and "file not found" in missing.stderr


def _merging_tokenizer(chats: list[list[dict]]):
    """A byte-level BPE trained on ``chats`` (merges within words, across digits and markup),
    with the tiny model's ChatML template: unlike one token per byte, a text's ids depend on
    where it is cut."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from prime_core.testing.chat import CHATML

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator([m["content"] for chat in chats for m in chat], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", unk_token=None,
                                   chat_template=CHATML)


def test_a_dataset_is_read_in_batches_token_for_token_as_chat_by_chat(tiny, tmp_path, monkeypatch, register_plugin,
                                                                      prime_cli):
    """load_dataset tokenises CHUNK chats per call (7 here: many chunks, a partial last one) and
    each distinct line once: its samples are chat_sample's, id for id, on the tool example's
    data (examples/tools/run.sh: calculator chats, 30% calling the tool) and the CPU example's
    (sums of one digit, which repeat), under the tiny model's tokenizer and a BPE one; a bad
    line is named as chat by chat names it."""
    from transformers import AutoTokenizer

    import prime_plugin_tasks.plugin as tasks
    from prime_core.errors import ConfigError
    from prime_core.sft import role

    register_plugin(tasks, name="tasks")
    files = {"tools": ("calculator", "--n", "300", "--demos", "0.3", "--args", '{"digits": 3}'),
             "cpu": ("arithmetic", "--n", "300", "--args", '{"digits": 1}')}
    chats = {}
    for name, args in files.items():
        result = prime_cli("envs", "sft-data", args[0], str(tmp_path / f"{name}.jsonl"), *args[1:])
        assert result.exit_code == 0, result.output
        chats[name] = [json.loads(line)["messages"] for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
    assert any(m["role"] == "tool" for chat in chats["tools"] for m in chat)
    assert len({json.dumps(chat) for chat in chats["cpu"]}) < len(chats["cpu"]), "repeated lines, read once"
    monkeypatch.setattr(role, "CHUNK", 7)
    for tokenizer in (AutoTokenizer.from_pretrained(tiny), _merging_tokenizer([*chats["tools"], *chats["cpu"]])):
        for name in files:
            batched = role.load_dataset(tmp_path / f"{name}.jsonl", tokenizer)
            one_by_one = [role.chat_sample(tokenizer, messages) for messages in chats[name]]
            assert batched == one_by_one, name

        # An assistant turn alone (no prompt to render), a last turn that is not the
        # assistant's, and a line that is not JSON after them: the first bad line is named.
        for bad in ([{"role": "assistant", "content": "4"}], chats["tools"][0][:-1]):
            lines = [json.dumps({"messages": m}) for m in [*chats["cpu"][:9], bad, *chats["cpu"][9:20]]] + ["{"]
            (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
            with pytest.raises(ValueError) as alone:
                role.chat_sample(tokenizer, bad)
            with pytest.raises(ConfigError) as read:
                role.load_dataset(tmp_path / "bad.jsonl", tokenizer)
            assert read.value.problems == [f"data.path: {tmp_path / 'bad.jsonl'}, line 10: {alone.value}"]


def test_a_chat_is_trained_on_its_assistant_turns(tiny):
    """prime-rl's SFT data: every assistant turn (content through end of turn) is trained, the
    other roles' turns and the assistant headers are not; prompt + completion is the same chat."""
    from transformers import AutoTokenizer

    from prime_core.sft.config import LossMaskConfig
    from prime_core.sft.hf import masked_sample, row_messages
    from prime_core.sft.role import chat_sample

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3"},
            {"role": "assistant", "content": "6"}]
    sample = masked_sample(tokenizer, chat, LossMaskConfig())
    ids = sample.prompt_ids + sample.completion_ids
    mask = [0] * len(sample.prompt_ids) + sample.completion_mask
    trained = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert trained == "4<|im_end|>6<|im_end|>", trained
    assert tokenizer.apply_chat_template(chat, tokenize=False).startswith(tokenizer.decode(ids))
    everything = masked_sample(tokenizer, chat, LossMaskConfig(system=True, user=True))
    assert sum(everything.completion_mask) > sum(sample.completion_mask)
    assert "be brief" in tokenizer.decode(everything.completion_ids)

    pair = row_messages({"prompt": "2+2", "completion": [{"content": "4"}]})
    single = masked_sample(tokenizer, pair, LossMaskConfig())
    reference = chat_sample(tokenizer, pair)  # the JSONL path's sample of the same chat
    assert (single.prompt_ids, single.completion_ids) == (reference.prompt_ids, reference.completion_ids)
    with pytest.raises(ValueError, match="'messages' column, or both 'prompt' and 'completion'"):
        row_messages({"text": "hi"})


def _saved_dataset(folder: Path) -> tuple[int, int]:
    import datasets

    chats = [{"messages": [{"role": "user", "content": f"{a}+{b}"}, {"role": "assistant", "content": str(a + b)}]}
             for a in range(4) for b in range(4)]
    pairs = [{"prompt": [{"role": "user", "content": f"{a}*{b}"}], "completion": [{"role": "assistant",
                                                                                   "content": str(a * b)}]}
             for a in range(3) for b in range(3)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(chats),
                          "extra": datasets.Dataset.from_list(pairs)}).save_to_disk(str(folder))
    return len(chats), len(pairs)


@pytest.mark.slow
def test_sft_reads_a_datasets_dataset_in_prime_rl_layout(tiny, tmp_path):
    """prime-rl's `[data] name / splits / seq_len / micro_batch_size` unchanged: both splits of a
    dataset written with `save_to_disk`, one in the messages format, one in prompt-completion."""
    chats, pairs = _saved_dataset(tmp_path / "ds")
    config = tmp_path / "sft.toml"
    config.write_text(f'max_steps = 2\n\n[model]\nname = "{tiny}"\ndtype = "float32"\n\n'
                      f'[data]\nname = "{tmp_path}/ds"\nsplits = ["train", "extra"]\n'
                      'seq_len = 256\nbatch_size = 8\nmicro_batch_size = 2\n')
    result = prime("sft", str(config), "--output-dir", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    # interleaved in turn until both are used up (prime-rl's stopping_strategy = "all_exhausted")
    assert f"sft: {2 * max(chats, pairs)} samples, 2 steps of 8" in result.stdout, result.stdout
    assert "data.micro_batch_size = 2: prime packs samples" in result.stderr
    steps = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]


def test_a_dataset_that_is_not_here_is_named_with_the_fix(tmp_path, monkeypatch):
    """Offline, a hub id that is not in the local cache stops at once, naming it and the fix (the
    role raises this ConfigError before its first step: exit code 2, no traceback)."""
    import datasets

    from prime_core.errors import ConfigError
    from prime_core.sft.config import SFTDataConfig
    from prime_core.sft.hf import load_rows

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    data = SFTDataConfig.model_validate({"name": "PrimeIntellect/Not-Cached-SFT", "subsets": ["x"]})
    assert data.type == "sft"
    with pytest.raises(ConfigError) as err:
        load_rows(data)
    message = str(err.value)
    assert "data.name: sft: cannot load dataset 'PrimeIntellect/Not-Cached-SFT' (subset 'x', split 'train')" in message
    assert "offline (HF_HUB_OFFLINE=1), from the local cache" in message and "save_to_disk" in message
    assert err.value.exit_code == 2


def test_config_validate_names_a_dataset_offline_roles_would_not_find(tiny, tmp_path, monkeypatch, prime_cli):
    """The same dataset is refused before anything starts (``prime sft`` and ``--dry-run`` run
    these checks), from the cache's metadata only; a local folder is left to the role."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    datasets.Dataset.from_list([{"messages": [{"role": "user", "content": "1+1"}]}]).save_to_disk(tmp_path / "ds")
    args = ("config", "validate", "--root", "sft", "--model.name", str(tiny))
    result = prime_cli(*args, "--data.name", "PrimeIntellect/Not-Cached-SFT", "--data.splits", '["train", "test"]',
                       env={"HF_HUB_OFFLINE": "1"})
    out = " ".join(result.output.split())
    assert result.exit_code == 2, out
    for split in ("train", "test"):
        assert (f"data.name: sft: cannot load dataset 'PrimeIntellect/Not-Cached-SFT' (subset None, split '{split}') "
                "offline (HF_HUB_OFFLINE=1), from the local cache") in out, out
    assert prime_cli(*args, "--data.name", str(tmp_path / "ds"), env={"HF_HUB_OFFLINE": "1"}).exit_code == 0
    online = prime_cli(*args, "--data.name", "PrimeIntellect/Not-Cached-SFT", env={"HF_HUB_OFFLINE": "0"})
    assert "Not-Cached-SFT" not in online.output, "roles that may download are not held to the cache"
