"""One rollout: an environment's episode against the policy, recorded token for token.

The orchestrator gives each rollout an ``Episode``: the conversation so far (``messages``,
starting with the task's prompt), a ``state`` dict for the environment, and three calls:

- ``await episode.generate()`` samples the next assistant turn (the whole conversation is the
  prompt; see ``trajectory``) and returns a ``Turn`` (its text, finish reason and the tool
  calls the selected parser found), or ``None`` when a limit (``max_turns``, the token budget)
  leaves no room for another turn;
- ``episode.add(*messages)`` appends environment turns (``{"role": "user" | "tool", ...}``);
- ``await episode.call_tools(turn)`` runs the turn's calls with the environment's tools and
  adds one ``tool`` message per call: the result, or an error text for an unknown tool, bad
  arguments, a tool that raised or timed out (counted in ``tool_errors``).

``rollout(env, task, episode)`` runs an environment: its own ``async rollout(task, episode)``
when it has one, otherwise the standard loop (generate; run tool calls while there are any;
ask ``env.respond(task, messages, state)`` for a reply, ``None`` ending the episode) and the
reward from ``env.score_episode(task, episode)`` or, single-turn style, ``env.score(task,
completion)`` on the last assistant turn. A single-turn environment is the one-turn case.
"""

from __future__ import annotations

import asyncio
import math
import numbers
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from prime_core.inference.client import Sample, SampleRequest
from prime_core.orchestrator.tools import ParsedTurn, Tool, ToolError, run_call
from prime_core.orchestrator.trajectory import Trajectory, render


@dataclass(frozen=True)
class Limits:
    max_turns: int = 1
    """Model turns per episode."""
    max_tokens: int = 2048
    """Most tokens in the policy's context (prompt, every turn so far and the next one)."""
    turn_max_tokens: int | None = None
    """Most tokens per model turn (``sampling.max_tokens``)."""
    tool_timeout: float = 30.0


@dataclass(frozen=True)
class Turn:
    text: str
    finish_reason: str
    parsed: ParsedTurn

    @property
    def tool_calls(self):
        return self.parsed.tool_calls


class InferenceFailed(Exception):
    """The sampler failed (a server down): not the environment's fault, so it stops the run."""


def env_tools(env: Any, task: Any) -> list[Tool]:
    tools = getattr(env, "tools", None)
    if callable(tools):
        tools = tools(task)
    return list(tools or [])


@dataclass
class Episode:
    task: Any
    sampler: Callable[[SampleRequest], Awaitable[list[Sample]]]
    tokenizer: Any
    parse: Callable[[str], ParsedTurn]
    limits: Limits
    tools: list[Tool] = field(default_factory=list)
    session_id: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    messages: list[dict] = field(default_factory=list)
    state: dict = field(default_factory=dict)
    trajectory: Trajectory = field(default_factory=Trajectory)
    turns: int = 0
    stop_reason: str | None = None
    """Why the episode ended when a limit ended it: ``max_turns``, ``max_tokens``."""
    tool_calls: int = 0
    tool_errors: int = 0

    def __post_init__(self) -> None:
        if not self.messages:
            self.messages = [dict(m) for m in self.task.prompt]
        self._tools = {tool.name: tool for tool in self.tools}
        self._schemas = [tool.schema() for tool in self.tools] or None

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    @property
    def completion(self) -> str:
        """The text of the last assistant turn ("" before the first)."""
        return next((m["content"] for m in reversed(self.messages) if m.get("role") == "assistant"), "")

    def add(self, *messages: dict) -> None:
        for message in messages:
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise TypeError(f"an environment turn must be a dict with 'role' and 'content' strings, got "
                                f"{message!r:.200}")
            self.messages.append(message)

    async def generate(self) -> Turn | None:
        if self.done:
            return None
        self.trajectory.extend_to(render(self.tokenizer, self.messages, tools=self._schemas))
        room = self.limits.max_tokens - len(self.trajectory.context)
        if room < 1:
            self.stop_reason = "max_tokens"
            return None
        request = SampleRequest(prompt_ids=list(self.trajectory.context), n=1, temperature=self.temperature,
                                top_p=self.top_p, max_tokens=min(room, self.limits.turn_max_tokens or room),
                                seed=None if self.seed is None else self.seed + self.turns,
                                session_id=self.session_id)
        try:
            (sample,) = await self.sampler(request)
        except Exception as exc:
            raise InferenceFailed(str(exc)) from exc
        self.trajectory.add_sampled(list(sample.token_ids), list(sample.logprobs))
        self.turns += 1
        self.messages.append({"role": "assistant", "content": sample.text})
        parsed = self.parse(sample.text) if self._tools else ParsedTurn(content=sample.text)
        if self.turns >= self.limits.max_turns:
            self.stop_reason = "max_turns"
        elif len(self.trajectory.context) >= self.limits.max_tokens:
            self.stop_reason = "max_tokens"
        return Turn(text=sample.text, finish_reason=sample.finish_reason, parsed=parsed)

    async def call_tools(self, turn: Turn) -> list[dict]:
        """Run ``turn``'s tool calls in order; one ``tool`` message each is added and returned."""
        replies = []
        for call in turn.tool_calls:
            self.tool_calls += 1
            try:
                content = await run_call(call, self._tools, timeout=self.limits.tool_timeout)
            except ToolError as exc:
                self.tool_errors += 1
                content = f"error: {exc}"
            replies.append({"role": "tool", "content": content, "name": call.name or "unknown"})
        self.add(*replies)
        return replies


async def _call_env(fn, *args):
    """An environment's synchronous method in a worker thread (it may block)."""
    return await asyncio.to_thread(fn, *args)


async def rollout(env: Any, task: Any, episode: Episode) -> float:
    """Run one episode of ``env`` on ``task``; returns its reward (raises what the env raises)."""
    own = getattr(env, "rollout", None)
    if own is not None:
        reward = await own(task, episode)
    else:
        respond = getattr(env, "respond", None)
        while True:
            turn = await episode.generate()
            if turn is None:
                break
            if episode.tools and turn.tool_calls:
                await episode.call_tools(turn)
                continue
            if respond is None or episode.done:
                break
            reply = await _call_env(respond, task, episode.messages, episode.state)
            if not reply:
                break
            episode.add(*([reply] if isinstance(reply, dict) else reply))
        if hasattr(env, "score_episode"):
            reward = await _call_env(env.score_episode, task, episode)
        else:
            reward = await _call_env(env.score, task, episode.completion)
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        raise TypeError(f"the environment's reward is {reward!r}, not a finite number")
    return float(reward)


@dataclass
class Outcome:
    """A finished rollout: its reward, or why the environment failed it."""

    episode: Episode
    reward: float | None = None
    error: str | None = None


async def run_episode(env: Any, task: Any, episode: Episode) -> Outcome:
    """``rollout`` with the environment's failures caught: an exception raised by the
    environment (or a tool it runs itself) fails this rollout only. A failing sampler is not
    the environment's fault and propagates (``InferenceFailed``)."""
    import traceback

    try:
        return Outcome(episode, reward=await rollout(env, task, episode))
    except InferenceFailed as failed:
        raise failed.__cause__ from None  # the sampler's own error (a server down stops the run)
    except Exception as exc:
        where = traceback.extract_tb(exc.__traceback__)[-1]
        return Outcome(episode, error=f"{type(exc).__name__}: {exc} ({where.filename}:{where.lineno})")
