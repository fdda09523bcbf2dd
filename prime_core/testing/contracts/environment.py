"""Contract suite for environments (``prime_core.specs.Environment``).

The orchestrator calls ``spec.load(**args)`` once per ``[[orchestrator.env]]`` in its main
thread, then ``env.tasks(rng, n)`` from its event loop and ``env.score(task, completion)``
from worker threads (``asyncio.to_thread``), several at a time. This suite does the same::

    from prime_core.testing.contracts.environment import EnvironmentContract

    class TestReverseText(EnvironmentContract):
        name = "reverse_text"
        args = {"min_len": 2, "max_len": 4}
        plugin = "prime_plugin_tasks.plugin"    # or None: the installed plugin

It checks that ``load`` returns an object with ``tasks`` and ``score``; that ``tasks(rng, n)``
returns ``n`` ``Task`` objects, the same ones for the same seed whatever the global ``random``
state; that every prompt is a list of chat messages (``role`` and ``content`` strings) ending
with a turn the policy answers; that ``score`` returns a finite real number in
``reward_range`` for any string (empty, huge, unicode) and gives the same rewards from
concurrent worker threads as one at a time; that a task's reference ``answer`` scores at
least as well as any other completion tried; that the declared ``args`` model accepts
``args`` and describes what ``load()`` does by default; and that an unknown argument is
refused with a ``TypeError`` or ``ValueError`` (which the orchestrator reports under
``orchestrator.env[i].args``).

Episodes (multi-turn, tools): every environment, single-turn ones included, is run through
the orchestrator's episode loop (``prime_core.orchestrator.episode``) against a scripted
policy (``prime_core.testing.chat``) answering with the reference answer, with garbage, and,
for environments with tools, with a well-formed call of each tool, an unknown tool, and calls
that do not parse. The suite checks that no script makes the environment raise; that rewards
are finite and in ``reward_range``; that episodes end within ``max_turns``; that the
trajectory's trained tokens are exactly the sampled ones, with their log-probabilities, and
everything else has loss mask 0; that tools are ``Tool`` objects with OpenAI-style schemas;
that environment turns are chat messages; and that concurrent episodes give the same rewards
as one at a time (state kept per episode, in ``episode.state``, never on the environment).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import math
import numbers
import random
import threading
from typing import Any, ClassVar

import pytest

from prime_core.testing.contracts import Contract, ContractError, expect

ROLES = ("system", "user", "assistant", "tool")
COMPLETIONS = ("", "   \n", "x", "I think the answer is 42.", "<think>hmm</think>\ndone", "ü → 中文 🙂",
               "a" * 5000)
"""Completions every environment must score without raising: malformed output earns a low
reward, it does not fail the rollout."""


def load_env(spec, args: dict[str, Any]):
    env = spec.load(**args)
    expect(callable(getattr(env, "tasks", None)),
           f"environment '{spec.name}': load() returned {type(env).__name__}, which has no tasks() method")
    expect(any(callable(getattr(env, m, None)) for m in ("score", "score_episode", "rollout")),
           f"environment '{spec.name}': load() returned {type(env).__name__}, which has no score() method (nor "
           "score_episode() or rollout() for a multi-turn environment)")
    return env


def check_tools(env, tasks) -> list:
    """The tools an environment offers are ``Tool`` objects with OpenAI-style schemas."""
    from prime_core.orchestrator.episode import env_tools
    from prime_core.orchestrator.tools import Tool

    tools = env_tools(env, tasks[0])
    for tool in tools:
        expect(isinstance(tool, Tool), f"a tool is a {type(tool).__name__}, not prime_core.orchestrator.tools.Tool")
        schema = tool.schema()["function"]
        expect(isinstance(tool.name, str) and tool.name and callable(tool.fn), f"tool {tool!r:.100}: name and fn")
        expect(isinstance(schema["parameters"], dict) and schema["parameters"].get("type") == "object",
               f"tool '{tool.name}': parameters must be a JSON schema of type object, got "
               f"{schema['parameters']!r:.200}")
    expect(len({t.name for t in tools}) == len(tools), f"two tools share a name: {[t.name for t in tools]}")
    return tools


def scripts(env, task, tools) -> dict[str, Any]:
    """Named policies to run the episode with: each a list of turn texts (cycled)."""
    from prime_core.orchestrator.hermes import format_calls
    from prime_core.orchestrator.tools import ToolCall

    out: dict[str, Any] = {"garbage": list(COMPLETIONS[:6])}
    if task.answer is not None:
        out["answer"] = [task.answer]
    for tool in tools:
        arguments = {name: "1" for name in tool.parameters.get("required", [])}
        out[f"tool {tool.name}"] = [format_calls([ToolCall(name=tool.name, arguments=arguments)]),
                                    task.answer or "done"]
    if tools:
        out["unknown tool"] = [format_calls([ToolCall(name="no_such_tool_xyz", arguments={})])]
        out["malformed call"] = ["<tool_call>\n{\"name\": \"x\", \"arguments\": {oops\n</tool_call>", "<tool_call>"]
    return out


def run_episodes(env, tasks, script_for, *, max_turns: int, concurrency: int, tool_timeout: float = 5.0):
    """One episode per task with ``script_for(task)`` as the policy; returns their outcomes
    (and policies), run ``concurrency`` at a time on one event loop, as the orchestrator does."""
    from prime_core.orchestrator.episode import Episode, Limits, env_tools, run_episode
    from prime_core.orchestrator.hermes import parse
    from prime_core.testing.chat import ScriptedPolicy, chat_tokenizer

    tokenizer = chat_tokenizer()

    async def main():
        gate = asyncio.Semaphore(concurrency)

        async def one(i, task):
            async with gate:
                policy = ScriptedPolicy(tokenizer, script_for(task))
                episode = Episode(task=task, sampler=policy, tokenizer=tokenizer, parse=parse,
                                  limits=Limits(max_turns=max_turns, max_tokens=8192, turn_max_tokens=1024,
                                                tool_timeout=tool_timeout),
                                  tools=env_tools(env, task), session_id=f"contract-{i}")
                return await run_episode(env, task, episode), policy

        return await asyncio.gather(*(one(i, task) for i, task in enumerate(tasks)))

    return asyncio.run(main())


def check_trajectory(outcome, policy) -> None:
    """Trained tokens are exactly the sampled ones, in order, with their log-probabilities."""
    trajectory = outcome.episode.trajectory
    sampled = [(t, lp) for s in policy.samples for t, lp in zip(s.token_ids, s.logprobs, strict=True)]
    recorded = [(t, lp) for seg in trajectory.segments for t, m, lp in zip(seg.ids, seg.mask, seg.logprobs, strict=True)
                if m]
    expect(recorded == sampled, "the trajectory's trained tokens are not exactly the sampled tokens")
    for segment in trajectory.segments:
        expect(all(lp == 0.0 for m, lp in zip(segment.mask, segment.logprobs, strict=True) if not m),
               "tokens the policy did not sample carry log-probabilities")


def check_episodes(env, tasks, *, max_turns: int = 4, reward_range=(0.0, 1.0)) -> dict[str, list[float]]:
    """Every script on every task: no exception, finite rewards in range, at most ``max_turns``
    model turns, exact trajectories, chat-message environment turns. Returns rewards per script."""
    tools = check_tools(env, tasks)
    names = list(scripts(env, tasks[0], tools))
    rewards: dict[str, list[float]] = {}
    for name in names:
        results = run_episodes(env, tasks, lambda task, name=name: scripts(env, task, tools)[name],
                               max_turns=max_turns, concurrency=1)
        rewards[name] = []
        for outcome, policy in results:
            expect(outcome.error is None, f"policy '{name}': the episode raised {outcome.error}; the policy's "
                                          "mistakes must earn a low reward (or an error turn), not an exception")
            reward = outcome.reward
            if reward_range is not None:
                expect(reward_range[0] <= reward <= reward_range[1],
                       f"policy '{name}': reward {reward} is outside the reward range {reward_range}")
            expect(outcome.episode.turns <= max_turns, f"policy '{name}': {outcome.episode.turns} model turns with "
                                                       f"max_turns = {max_turns}")
            check_trajectory(outcome, policy)
            rewards[name].append(reward)
    return rewards


def check_concurrent_episodes(env, tasks, *, max_turns: int = 4) -> None:
    """Episodes at once give the rewards they give one at a time."""
    tools = check_tools(env, tasks)

    def script_for(task):
        options = scripts(env, task, tools)
        return options[sorted(options)[hash(str(task.prompt)) % len(options)]]

    serial = [o.reward for o, _ in run_episodes(env, tasks, script_for, max_turns=max_turns, concurrency=1)]
    together = [o.reward for o, _ in run_episodes(env, tasks, script_for, max_turns=max_turns, concurrency=8)]
    expect(serial == together, f"episodes run at once got rewards {together}, one at a time {serial}: keep "
                               "per-episode state in episode.state, not on the environment")


def draw(env, seed: int, n: int) -> list:
    from prime_core.orchestrator.env import Task

    tasks = env.tasks(random.Random(seed), n)
    expect(isinstance(tasks, list), f"tasks(rng, {n}) returned {type(tasks).__name__}, not a list")
    expect(len(tasks) == n, f"tasks(rng, {n}) returned {len(tasks)} tasks")
    for task in tasks:
        expect(isinstance(task, Task), f"tasks() returned a {type(task).__name__}, not a prime_core Task")
    return tasks


def check_tasks(env, seed: int = 0) -> list:
    """``tasks(rng, n)`` gives ``n`` tasks for several ``n``, deterministic in ``rng`` alone."""
    for n in (1, 3, 8):
        draw(env, seed, n)
    # Drawn twice: an environment that uses the global random state instead of ``rng`` differs.
    first, again = draw(env, seed, 8), draw(env, seed, 8)
    expect(first == again, "tasks(random.Random(seed), n) gave different tasks for the same seed")
    rng = random.Random(seed)  # the orchestrator draws one task at a time from one rng
    one_by_one = [env.tasks(rng, 1)[0] for _ in range(8)]
    rng = random.Random(seed)
    expect(one_by_one == [env.tasks(rng, 1)[0] for _ in range(8)],
           "drawing tasks one at a time from one rng is not reproducible")
    return first


def check_prompts(tasks) -> None:
    for i, task in enumerate(tasks):
        prompt = task.prompt
        expect(isinstance(prompt, list) and prompt, f"task {i}: prompt must be a non-empty list of chat messages, "
                                                    f"got {prompt!r:.200}")
        for message in prompt:
            expect(isinstance(message, dict) and isinstance(message.get("role"), str)
                   and isinstance(message.get("content"), str),
                   f"task {i}: every message needs 'role' and 'content' strings, got {message!r:.200}")
            expect(message["role"] in ROLES, f"task {i}: role {message['role']!r} is not one of {ROLES}")
        expect(prompt[-1]["role"] != "assistant",
               f"task {i}: the prompt ends with an assistant turn; the policy writes the next one")
        expect(task.answer is None or isinstance(task.answer, str),
               f"task {i}: answer must be a string or None, got {type(task.answer).__name__}")
        expect(isinstance(task.info, dict), f"task {i}: info must be a dict, got {type(task.info).__name__}")


def _pairs(tasks, completions) -> list[tuple[Any, str]]:
    """Every (task, completion) to score, tasks interleaved so that concurrent calls see
    different tasks (as the orchestrator's concurrent rollouts do)."""
    per_task = [[(t, c) for c in ([t.answer] if t.answer is not None else []) + list(completions)] for t in tasks]
    return [pair for group in itertools.zip_longest(*per_task) for pair in group if pair is not None]


def _run_in_threads(env, pairs, concurrency: int) -> list:
    """``env.score`` on every pair from ``concurrency`` worker threads, as the orchestrator's
    ``asyncio.to_thread`` calls do. The threads are all started before the first call: on a
    loaded machine, starting one can take longer than a racy ``score`` needs to finish alone."""
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        started = threading.Barrier(concurrency)
        for future in [pool.submit(started.wait, 30) for _ in range(concurrency)]:
            future.result()

        async def main():
            loop = asyncio.get_running_loop()
            semaphore = asyncio.Semaphore(concurrency)

            async def one(task, completion):
                async with semaphore:
                    return await loop.run_in_executor(pool, env.score, task, completion)

            return await asyncio.gather(*(one(t, c) for t, c in pairs))

        return asyncio.run(main())


CONCURRENT_ROUNDS = 3
"""Concurrent rounds compared with the serial one: a race need not show in every round."""


def check_scores(env, tasks, completions=COMPLETIONS, reward_range: tuple[float, float] | None = (0.0, 1.0)) -> list:
    """``score`` from worker threads: a finite real in ``reward_range`` for every completion,
    the same concurrently as one at a time. Returns the rewards, in ``_pairs`` order."""
    pairs = _pairs(tasks, completions)
    try:
        serial = _run_in_threads(env, pairs, 1)
    except Exception as exc:
        raise ContractError(f"score() raised {type(exc).__name__}: {exc}; a completion it cannot parse earns a low "
                            "reward instead") from exc
    for (_task, completion), reward in zip(pairs, serial, strict=True):
        shown = f"score(task, {completion!r:.40})"
        expect(isinstance(reward, numbers.Real) and not isinstance(reward, bool),
               f"{shown} returned {type(reward).__name__}, not a real number")
        expect(math.isfinite(float(reward)), f"{shown} returned {reward}, not a finite number")
        if reward_range is not None:
            low, high = reward_range
            expect(low <= float(reward) <= high, f"{shown} = {reward} is outside the reward range [{low}, {high}]")
    for _ in range(CONCURRENT_ROUNDS):
        try:
            concurrent_rewards = _run_in_threads(env, pairs, 8)
        except Exception as exc:
            raise ContractError(f"score() raised {type(exc).__name__} when called from several threads at once: "
                                f"{exc}") from exc
        expect([float(r) for r in serial] == [float(r) for r in concurrent_rewards],
               "score() gave other rewards when called from several threads at once (shared state?)")
    return serial


def check_answer_scores_best(env, tasks, completions=COMPLETIONS) -> None:
    """A task's reference answer earns at least the reward of any other completion."""
    for i, task in enumerate(tasks):
        if task.answer is None:
            continue
        best = float(env.score(task, task.answer))
        for completion in completions:
            reward = float(env.score(task, completion))
            expect(reward <= best, f"task {i}: {completion!r:.40} scores {reward}, more than the reference answer "
                                   f"{task.answer!r:.40} ({best})")


def check_args(spec, args: dict[str, Any]) -> None:
    """The declared ``args`` model accepts ``args``, and its defaults are ``load()``'s."""
    from prime_core.config.env_args import check_env_args

    problems = check_env_args(spec, args, "args")
    expect(not problems, f"environment '{spec.name}' refuses the suite's args: " + "; ".join(problems))
    model = spec.args
    if model is None:
        return
    defaults = model().model_dump()
    plain, declared = load_env(spec, {}), load_env(spec, defaults)
    expect(draw(plain, 0, 8) == draw(declared, 0, 8),
           f"environment '{spec.name}': load() and load(**{model.__name__}().model_dump()) draw different tasks; "
           "the args model's defaults must be load()'s")


def check_unknown_arg_refused(spec, args: dict[str, Any]) -> None:
    from prime_core.config.env_args import check_env_args

    bad = {**args, "no_such_argument_xyz": 1}
    if spec.args is not None:
        expect(check_env_args(spec, bad, "args"), f"environment '{spec.name}': its args model accepts an unknown "
                                                  "argument; derive it from prime_core.config.base.Section")
    try:
        spec.load(**bad)
    except (TypeError, ValueError):
        return
    except Exception as exc:
        raise ContractError(f"environment '{spec.name}': an unknown argument raised {type(exc).__name__}; raise "
                            "TypeError or ValueError so the orchestrator names orchestrator.env[i].args") from exc
    raise ContractError(f"environment '{spec.name}': load() accepted an unknown argument 'no_such_argument_xyz'")


class EnvironmentContract(Contract):
    """Subclass with ``name`` (and ``args``, ``plugin``) set; see the module docstring."""

    registry = "environments"
    args: ClassVar[dict[str, Any]] = {}
    """Keyword arguments for ``load``, as ``[[orchestrator.env]] args`` would give them."""
    reward_range: ClassVar[tuple[float, float] | None] = (0.0, 1.0)
    """Every reward lies in this range; ``None``: any finite number."""
    completions: ClassVar[tuple[str, ...]] = COMPLETIONS
    answer_scores_best: ClassVar[bool] = True
    seed: ClassVar[int] = 0
    max_turns: ClassVar[int] = 4
    """Model turns per episode in the episode checks."""

    @pytest.fixture
    def env(self, spec):
        return load_env(spec, self.args)

    def test_tasks_are_n_and_reproducible(self, env):
        check_tasks(env, self.seed)

    def test_prompts_are_chat_messages(self, env):
        check_prompts(draw(env, self.seed, 8))

    def test_score_from_worker_threads(self, env):
        if not callable(getattr(env, "score", None)):
            pytest.skip("no score(task, completion): a multi-turn environment scored by score_episode or rollout")
        check_scores(env, draw(env, self.seed, 4), self.completions, self.reward_range)

    def test_reference_answer_scores_best(self, env):
        if not callable(getattr(env, "score", None)):
            pytest.skip("no score(task, completion)")
        if not self.answer_scores_best:
            pytest.skip("answer_scores_best = False: this environment's answers are not the best completions")
        check_answer_scores_best(env, draw(env, self.seed, 4), self.completions)

    def test_episodes_with_scripted_policies(self, env):
        if not callable(getattr(env, "score", None)) and not callable(getattr(env, "score_episode", None)) \
                and not callable(getattr(env, "rollout", None)):
            pytest.skip("no rubric")
        check_episodes(env, draw(env, self.seed, 3), max_turns=self.max_turns, reward_range=self.reward_range)

    def test_concurrent_episodes_are_independent(self, env):
        check_concurrent_episodes(env, draw(env, self.seed, 8), max_turns=self.max_turns)

    def test_declared_args(self, spec):
        check_args(spec, self.args)

    def test_unknown_argument_is_refused(self, spec):
        check_unknown_arg_refused(spec, self.args)
