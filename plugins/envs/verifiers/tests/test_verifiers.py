"""The verifiers adapter on tasksets written in the tests (conftest.py): the task's prompt as
verifiers' null harness would send it, the task's own rewards weighted and summed as verifiers
sums them, and what prime's single-turn rollouts cannot run refused with the reason."""

import difflib
import json
import random

import pytest

import prime_plugin_verifiers.plugin as plugin
from prime_core import PLUGIN_API_VERSION

pytest_plugins = ["prime_core.testing"]


def load(**args):
    return plugin.prime_environments()[0].load(**args)


def test_declares_the_plugin_api():
    assert plugin.PRIME_PLUGIN_API == PLUGIN_API_VERSION


def test_prompts_and_rewards_come_from_the_taskset():
    env = load(taskset={"id": "prime-vf-reverse", "count": 6, "words": 2})
    tasks = env.tasks(random.Random(0), 20)
    assert len(env.tasks_) == 6 and {t.info["index"] for t in tasks} <= set(range(6))
    for task in tasks:
        system, user = task.prompt
        assert system == {"role": "system", "content": "Reply with the reversed text only."}
        assert user["role"] == "user" and user["content"].startswith("Reverse this text: ")
        text = user["content"].removeprefix("Reverse this text: ")
        assert task.answer is None, "no answer_field: no reference completion"
        assert env.score(task, text[::-1]) == 1.0
        assert env.score(task, f"  {text[::-1]}\n") == 1.0, "verifiers compares the stripped reply"
        half = text[::-1][: len(text) // 2]
        expected = 0.75 * difflib.SequenceMatcher(None, half.strip(), text[::-1]).ratio()  # + 0.25 * exact (0)
        assert env.score(task, half) == pytest.approx(expected)
        assert env.score(task, text) < 1.0


def test_a_plain_id_and_the_reference_answer():
    env = load(taskset="prime-vf-reverse", answer_field="answer")
    task = env.tasks(random.Random(3), 1)[0]
    assert task.answer == task.prompt[-1]["content"].removeprefix("Reverse this text: ")[::-1]
    assert env.score(task, task.answer) == 1.0
    with pytest.raises(ValueError, match="answer_field: the tasks of 'prime-vf-reverse' have no field 'solution'"):
        load(taskset="prime-vf-reverse", answer_field="solution")


def test_an_infinite_taskset_needs_a_limit():
    with pytest.raises(ValueError, match="limit: verifiers taskset 'prime-vf-endless' is infinite"):
        load(taskset="prime-vf-endless")
    env = load(taskset="prime-vf-endless", limit=5)
    assert sorted({t.info["index"] for t in env.tasks(random.Random(0), 30)}) == list(range(5))


@pytest.mark.parametrize(("args", "message"), [
    ({"taskset": "prime-vf-nowhere"}, "taskset.id: taskset 'prime-vf-nowhere' not found (tried to import "
                                      "'prime_vf_nowhere')"),
    ({"taskset": {"id": "prime-vf-reverse", "count": "many"}}, "taskset.count: Input should be a valid integer"),
    ({"taskset": {"id": "prime-vf-reverse", "cuont": 3}}, "taskset.cuont: Extra inputs are not permitted"),
    ({"taskset": {"count": 3}}, "taskset.id: name the verifiers taskset to run"),
    ({"taskset": "prime-vf-tools"}, "taskset: verifiers taskset 'prime-vf-tools' gives the model tools (toolsets)"),
])
def test_what_cannot_run_is_refused_by_config_validate_and_load(register_plugin, prime_cli, args, message):
    with pytest.raises(ValueError) as err:
        load(**args)
    assert message in str(err.value)
    register_plugin(plugin, name="verifiers")
    result = prime_cli("config", "validate", "--orchestrator.env", json.dumps([{"id": "verifiers", "args": args}]))
    assert result.exit_code == 2
    assert f"orchestrator.env[0].args: {message}" in " ".join(result.output.split())


def test_a_reward_that_needs_a_sandbox_is_refused_when_loading():
    with pytest.raises(ValueError, match="scores with wrote_file, which need a runtime"):
        load(taskset="prime-vf-sandboxed")


def test_good_args_pass_config_validate(register_plugin, prime_cli):
    register_plugin(plugin, name="verifiers")
    env = [{"id": "verifiers", "args": {"taskset": {"id": "prime-vf-reverse", "words": 4}, "limit": 3}}]
    assert "orchestrator.env" not in prime_cli("config", "validate", "--orchestrator.env", json.dumps(env)).output
