"""The built-in environments: deterministic tasks, rewards that tell right from wrong."""

import random

import pytest

import prime_plugin_tasks.plugin as plugin
from prime_core import PLUGIN_API_VERSION

pytest_plugins = ["prime_core.testing"]


def test_declares_the_plugin_api():
    assert plugin.PRIME_PLUGIN_API == PLUGIN_API_VERSION


def _envs():
    return {e.name: e for e in plugin.prime_environments()}


def test_reverse_text_tasks_and_reward():
    env = _envs()["reverse_text"].load(min_len=3, max_len=5)
    tasks = env.tasks(random.Random(0), 20)
    assert tasks == env.tasks(random.Random(0), 20), "same seed, same tasks"
    for task in tasks:
        text = task.prompt[-1]["content"]
        assert 3 <= len(text) <= 5 and task.answer == text[::-1]
        assert env.score(task, task.answer) == 1.0
        assert env.score(task, " " + task.answer + "\n") == 1.0
        assert env.score(task, "") == 0.0
    task = tasks[0]
    assert 0 < env.score(task, task.answer[:-1]) < 1.0, "partial credit"


def test_arithmetic_tasks_and_reward():
    env = _envs()["arithmetic"].load(digits=2)
    for task in env.tasks(random.Random(1), 20):
        a, b = task.info["numbers"]
        assert task.prompt[-1]["content"] == f"{a}+{b}"
        assert env.score(task, str(a + b)) == 1.0 and env.score(task, str(a + b + 1)) == 0.0


def test_bad_args_are_refused():
    with pytest.raises(ValueError, match="min_len"):
        _envs()["reverse_text"].load(min_len=5, max_len=2)
    with pytest.raises(TypeError):
        _envs()["arithmetic"].load(digts=2)


def test_selectable_by_name(register_plugin, prime_cli):
    register_plugin(plugin, name="tasks")
    assert prime_cli("config", "show", "--orchestrator.env", '[{"id": "reverse_text"}]').exit_code == 0
    result = prime_cli("config", "validate", "--orchestrator.env", '[{"id": "reverse_txt"}]')
    assert "did you mean 'reverse_text'" in result.output
    # prime-rl's spelling of the id selects the same environment, its args checked as ours.
    result = prime_cli("config", "validate", "--orchestrator.env", '[{"id": "reverse-text", "args": {"max_len": 0}}]')
    assert "orchestrator.env[0].id" not in result.output
    assert "orchestrator.env[0].args.max_len: Input should be greater than or equal to 1" in result.output


def test_sft_data_command(register_plugin, prime_cli, tmp_path):
    import json

    register_plugin(plugin, name="tasks")
    out = tmp_path / "sft.jsonl"
    result = prime_cli("envs", "sft-data", "reverse_text", str(out), "--n", "5",
                       "--args", '{"min_len": 4, "max_len": 4}')
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 5
    for row in rows:
        *prompt, answer = row["messages"]
        assert answer["role"] == "assistant" and answer["content"] == prompt[-1]["content"][::-1]
