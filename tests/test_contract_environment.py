"""The environment contract suite fails on environments that break the contract, each for
the promise it breaks, and a subclass run by pytest fails on a broken plugin."""

import random
import textwrap
import threading
import time

import pytest
from pydantic import Field

from prime_core.config.base import Section
from prime_core.orchestrator.env import Task
from prime_core.specs import Environment
from prime_core.testing.contracts import ContractError
from prime_core.testing.contracts import environment as contract

pytest_plugins = ["pytester"]


class Echo:
    """A correct environment: repeat a word."""

    def __init__(self, words: int = 1) -> None:
        self.words = words

    def tasks(self, rng, n):
        out = []
        for _ in range(n):
            word = " ".join(f"w{rng.randrange(10**6)}" for _ in range(self.words))
            out.append(Task(prompt=[{"role": "user", "content": word}], answer=word))
        return out

    def score(self, task, completion):
        return 1.0 if completion.strip() == task.answer else 0.0


class EchoArgs(Section):
    words: int = Field(default=1, ge=1)


def spec(load=Echo, args=EchoArgs):
    return Environment(name="echo", load=load, args=args)


def test_a_correct_environment_passes():
    env = contract.load_env(spec(), {"words": 2})
    tasks = contract.check_tasks(env)
    contract.check_prompts(tasks)
    contract.check_scores(env, tasks)
    contract.check_answer_scores_best(env, tasks)
    contract.check_args(spec(), {"words": 2})
    contract.check_unknown_arg_refused(spec(), {})


class ShortBy1(Echo):
    def tasks(self, rng, n):
        return super().tasks(rng, n)[:-1]


class GlobalRandom(Echo):
    def tasks(self, rng, n):
        return super().tasks(random.Random(random.random()), n)


class StringPrompt(Echo):
    def tasks(self, rng, n):
        return [Task(prompt=t.prompt[0]["content"], answer=t.answer) for t in super().tasks(rng, n)]


class AssistantLast(Echo):
    def tasks(self, rng, n):
        return [Task(prompt=[*t.prompt, {"role": "assistant", "content": "ok"}], answer=t.answer)
                for t in super().tasks(rng, n)]


@pytest.mark.parametrize(("env", "message"), [
    (ShortBy1(), r"tasks\(rng, 1\) returned 0 tasks"),
    (GlobalRandom(), "different tasks for the same seed"),
])
def test_tasks_violations(env, message):
    with pytest.raises(ContractError, match=message):
        contract.check_tasks(env)


@pytest.mark.parametrize(("env", "message"), [
    (StringPrompt(), "prompt must be a non-empty list of chat messages"),
    (AssistantLast(), "ends with an assistant turn"),
])
def test_prompt_violations(env, message):
    with pytest.raises(ContractError, match=message):
        contract.check_prompts(env.tasks(random.Random(0), 2))


class BoolReward(Echo):
    def score(self, task, completion):
        return completion.strip() == task.answer


class TooHigh(Echo):
    def score(self, task, completion):
        return 2.0 * super().score(task, completion)


class ChokesOnEmpty(Echo):
    def score(self, task, completion):
        return 1.0 / len(completion)


class SharedState(Echo):
    """Keeps the task being scored on the instance: wrong as soon as two threads score."""

    def score(self, task, completion):
        self.current = task
        time.sleep(0.01)
        return 1.0 if completion.strip() == self.current.answer else 0.0


class NaN(Echo):
    def score(self, task, completion):
        return float("nan")


@pytest.mark.parametrize(("env", "message"), [
    (BoolReward(), "returned bool, not a real number"),
    (TooHigh(), r"outside the reward range \[0.0, 1.0\]"),
    (ChokesOnEmpty(), "score\\(\\) raised ZeroDivisionError"),
    (SharedState(), "other rewards when called from several threads"),
    (NaN(), "not a finite number"),
])
def test_score_violations(env, message):
    tasks = env.tasks(random.Random(0), 4)
    with pytest.raises(ContractError, match=message):
        contract.check_scores(env, tasks)


def test_scores_run_in_worker_threads():
    seen = set()

    class Recording(Echo):
        def score(self, task, completion):
            seen.add(threading.current_thread() is threading.main_thread())
            return super().score(task, completion)

    env = Recording()
    contract.check_scores(env, env.tasks(random.Random(0), 2))
    assert seen == {False}


def test_an_answer_that_is_not_the_best_fails():
    class Inverted(Echo):
        def score(self, task, completion):
            return 1.0 - super().score(task, completion)

    env = Inverted()
    with pytest.raises(ContractError, match="more than the reference answer"):
        contract.check_answer_scores_best(env, env.tasks(random.Random(0), 2))


def test_args_model_defaults_must_be_loads():
    class WrongDefault(Section):
        words: int = 3

    with pytest.raises(ContractError, match="the args model's defaults must be load\\(\\)'s"):
        contract.check_args(spec(args=WrongDefault), {})


def test_args_the_model_refuses_fail():
    with pytest.raises(ContractError, match="refuses the suite's args: args.words"):
        contract.check_args(spec(), {"words": 0})


def test_unknown_arguments_must_be_refused():
    def swallow(**_ignored):
        return Echo()

    with pytest.raises(ContractError, match="accepted an unknown argument"):
        contract.check_unknown_arg_refused(spec(load=swallow, args=None), {})

    def crash(**_ignored):
        raise KeyError("boom")

    with pytest.raises(ContractError, match="raised KeyError"):
        contract.check_unknown_arg_refused(spec(load=crash, args=None), {})


PLUGIN = """
    from prime_core import hookimpl
    from prime_core.orchestrator.env import Task
    from prime_core.specs import Environment

    PRIME_PLUGIN_API = 1


    class Echo:
        def tasks(self, rng, n):
            return [Task(prompt=[{"role": "user", "content": w}], answer=w)
                    for w in (rng.choice(["a", "b"]) for _ in range(n))]

        def score(self, task, completion):
            return {score}


    @hookimpl
    def prime_environments():
        return [Environment(name="echo", load=lambda: Echo())]
"""

SUITE = """
    from prime_core.testing.contracts.environment import EnvironmentContract


    class TestEcho(EnvironmentContract):
        name = "echo"
        plugin = "echo_plugin"
"""


@pytest.mark.parametrize(("score", "failed"), [("1.0 if completion == task.answer else 0.0", 0),
                                               ("len(completion)", 2)])
def test_the_suite_as_pytest_runs_it(pytester, score, failed):
    pytester.makepyfile(echo_plugin=textwrap.dedent(PLUGIN).replace("{score}", score),
                        test_echo=textwrap.dedent(SUITE))
    pytester.syspathinsert()
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    # A reward of len(completion) leaves [0, 1] and beats the reference answer.
    result.assert_outcomes(passed=9 - failed, failed=failed)


class Countdown(Echo):
    """A correct multi-turn environment: the user counts down from the word's length, one
    reply per model turn; the reward is the share of turns the model echoed the word."""

    def respond(self, task, messages, state):
        state["left"] = state.get("left", 3) - 1
        return {"role": "user", "content": str(state["left"])} if state["left"] > 0 else None

    def score_episode(self, task, episode):
        replies = [m["content"] for m in episode.messages if m["role"] == "assistant"]
        return sum(r.strip() == task.answer for r in replies) / len(replies)


def test_a_correct_multi_turn_environment_passes():
    env = Countdown()
    tasks = env.tasks(random.Random(0), 3)
    rewards = contract.check_episodes(env, tasks, max_turns=4)
    assert rewards["answer"] == [1.0, 1.0, 1.0] and rewards["garbage"] == [0.0, 0.0, 0.0]
    contract.check_concurrent_episodes(env, env.tasks(random.Random(0), 8))


class RaisesOnGarbage(Countdown):
    def respond(self, task, messages, state):
        int(messages[-1]["content"].split()[0])  # the model wrote no number: ValueError
        return super().respond(task, messages, state)


class SharedCounter(Countdown):
    """Keeps the episode's state on the environment: wrong as soon as two run at once."""

    def respond(self, task, messages, state):
        self.left = getattr(self, "left", 3) - 1
        if self.left <= 0:
            self.left = 3
            return None
        return {"role": "user", "content": str(self.left)}

    def score_episode(self, task, episode):
        return episode.turns / 4


class BadTurn(Countdown):
    def respond(self, task, messages, state):
        return {"role": "user", "content": 3}


class BadTool(Echo):
    from prime_core.orchestrator.tools import Tool

    tools = [Tool(name="t", fn=lambda: 1, parameters={"type": "string"})]


@pytest.mark.parametrize(("env", "check", "message"), [
    (RaisesOnGarbage(), contract.check_episodes, "policy 'garbage': the episode raised IndexError"),
    (BadTurn(), contract.check_episodes, "an environment turn must be a dict with 'role' and 'content' strings"),
    (BadTool(), contract.check_episodes, "parameters must be a JSON schema of type object"),
])
def test_episode_violations(env, check, message):
    with pytest.raises(ContractError, match=message):
        check(env, env.tasks(random.Random(0), 3))


def test_state_on_the_environment_fails_the_concurrency_check():
    env = SharedCounter()
    with pytest.raises(ContractError, match="keep per-episode state in episode.state"):
        for _ in range(5):  # interleaving is up to the event loop: fail at least once
            contract.check_concurrent_episodes(env, env.tasks(random.Random(0), 8))
