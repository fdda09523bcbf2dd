"""reasoning-gym as an environment: answers worked out here, independently of the dataset's own
reference, score 1 and wrong ones do not; the answer is found where reasoning-gym's extraction
looks; every dataset is there and bad settings are refused before anything starts."""

import json
import random
import re
from fractions import Fraction

import pytest

import prime_plugin_reasoning_gym.plugin as plugin
from prime_core import PLUGIN_API_VERSION

pytest_plugins = ["prime_core.testing"]


def load(**args):
    return plugin.prime_environments()[0].load(**args)


def test_declares_the_plugin_api():
    assert plugin.PRIME_PLUGIN_API == PLUGIN_API_VERSION


def _arithmetic(question: str) -> str:
    expression = re.search(r"(?:Calculate|problem:)\s*(.*?)\s*[.=]?\s*$", question).group(1)
    # Exact rational arithmetic, so that "-8 / 1" is -8 and nothing is rounded.
    value = eval(re.sub(r"(\d+)", r"Fraction(\1)", expression), {"Fraction": Fraction})  # noqa: S307 - our digits
    assert value.denominator == 1, question
    return str(value.numerator)


def _backward(question: str) -> str:
    return question.rsplit(":", 1)[1].strip()[::-1]


def _sorted_words(question: str) -> str:
    words = question.rsplit(":", 1)[1].strip().split(", ")
    descending = "descending" in question.rsplit("Now,", 1)[1]
    return ", ".join(sorted(words, reverse=descending))


SOLVERS = {"basic_arithmetic": _arithmetic, "chain_sum": _arithmetic, "spell_backward": _backward,
           "word_sorting": _sorted_words}


@pytest.mark.parametrize("dataset", sorted(SOLVERS))
def test_answers_worked_out_here_score_one_and_wrong_ones_do_not(dataset):
    env = load(dataset=dataset, seed=3)
    for task in env.tasks(random.Random(0), 6):
        right = SOLVERS[dataset](task.prompt[-1]["content"])
        wrong = str(int(right) + 1) if right.lstrip("-").isdigit() else right[::-1] + "x"
        assert env.score(task, f"<answer>{right}</answer>") == 1.0, (task.prompt[-1]["content"], right)
        assert env.score(task, f"<think>it is {wrong}</think>\n<answer>{right}</answer>") == 1.0
        assert env.score(task, f"<answer>{wrong}</answer>") < 0.5, (task.prompt[-1]["content"], wrong)
        assert env.score(task, right) == 0.0, "no <answer> tags: reasoning-gym extracts nothing"
        assert env.score(task, f"<answer>{right}</answer> or rather <answer>{wrong}</answer>") < 0.5, "the last counts"


def test_countdown_accepts_any_expression_that_reaches_the_target():
    env = load(dataset="countdown", min_numbers=3, max_numbers=3)
    for task in env.tasks(random.Random(1), 5):
        expression = re.fullmatch(r"<answer>(.*)</answer>", task.answer).group(1)
        assert env.score(task, f"<answer>({expression})</answer>") == 1.0, "same value, written differently"
        assert env.score(task, f"<answer>{expression} + 1</answer>") < 0.5, "a number that was not given"
        assert env.score(task, f"<answer>{expression} * 0</answer>") < 0.5, "not the target"


def test_prompt_asks_for_answer_tags_and_task_is_the_drawn_index():
    env = load(dataset="spell_backward", seed=5, size=50)
    tasks = env.tasks(random.Random(2), 3)
    again = [env.dataset[t.info["index"]] for t in tasks]
    for task, entry in zip(tasks, again, strict=True):
        system, user = task.prompt
        assert system["role"] == "system" and "<answer>" in system["content"]
        assert user == {"role": "user", "content": entry["question"]}
        assert 0 <= task.info["index"] < 50 and task.answer == f"<answer>{entry['answer']}</answer>"
    assert load(dataset="spell_backward", system_prompt=None).tasks(random.Random(0), 1)[0].prompt[0]["role"] == "user"
    assert load(dataset="spell_backward", system_prompt="Be brief.").tasks(random.Random(0), 1)[0].prompt[0] == {
        "role": "system", "content": "Be brief."}


def test_every_dataset_of_the_package_is_offered():
    from reasoning_gym.factory import DATASETS

    for name in sorted(DATASETS):
        if name != "composite":  # a composite needs its parts named
            assert load(dataset=name).dataset.__class__ is DATASETS[name][0]


@pytest.mark.parametrize(("args", "message"), [
    ({"dataset": "countdwn"}, "dataset: reasoning-gym has no dataset 'countdwn' (did you mean 'countdown'?); "
                              "available: ab, acre,"),
    ({"min_numbrs": 3}, "min_numbrs: dataset 'countdown' has no setting 'min_numbrs' (did you mean 'min_numbers'?)"),
    ({"min_numbers": "three"}, "min_numbers: Input should be a valid integer"),
    ({"min_numbers": 1}, "dataset 'countdown' refuses its settings: min_numbers must be greater than 1"),
    ({"dataset": "composite", "datasets": [{"name": "chain_sum", "weight": 1, "config": {"terms": 2}}]},
     "terms: dataset 'chain_sum' has no setting 'terms'"),
])
def test_bad_settings_are_refused_by_config_validate_and_by_load(register_plugin, prime_cli, args, message):
    with pytest.raises(ValueError) as err:
        load(**args)
    assert message in str(err.value)
    register_plugin(plugin, name="reasoning_gym")
    result = prime_cli("config", "validate", "--orchestrator.env", json.dumps([{"id": "reasoning-gym", "args": args}]))
    assert result.exit_code == 2
    assert f"orchestrator.env[0].args: {message}" in " ".join(result.output.split())


def test_good_settings_pass_config_validate(register_plugin, prime_cli):
    register_plugin(plugin, name="reasoning_gym")
    env = [{"id": "reasoning-gym", "args": {"dataset": "countdown", "min_numbers": 3, "operators": ["+", "*"]}}]
    assert "orchestrator.env" not in prime_cli("config", "validate", "--orchestrator.env", json.dumps(env)).output
