"""Tools an environment offers the policy, the calls parsed from its text, and running them.

A ``Tool`` is a Python callable with an OpenAI-style schema (``{"type": "function",
"function": {"name", "description", "parameters"}}``): the chat template shows the schemas to
the model, a tool parser (``prime_tool_parsers``, ``orchestrator.rollout.tool_parser``) finds
the calls in the model's text, and ``run_call`` runs one with a timeout. Nothing here raises
for the model's mistakes: an unknown tool, arguments that do not fit, a tool that raises or
hangs each come back as an error text that the episode answers with a tool turn.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """One call as the parser found it. ``error`` says why a call could not be read (bad
    JSON, no name); such a call is answered with that error instead of being run."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    id: str = ""
    error: str | None = None


@dataclass(frozen=True)
class ParsedTurn:
    """An assistant turn split into its text outside tool calls and the calls, in order."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class Tool:
    """A function the policy may call. ``fn(**arguments)`` returns the result (converted with
    ``str``; dicts and lists as JSON); it may be ``async``. A plain function runs in a worker
    thread, so it may block, up to ``orchestrator.rollout.tool_timeout`` seconds."""

    name: str
    fn: Callable[..., Any]
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    """JSON schema of the keyword arguments (OpenAI's ``parameters``)."""

    def schema(self) -> dict[str, Any]:
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


class ToolError(Exception):
    """A call that could not be answered with a result (its message is the error turn)."""


def _missing_or_unknown(tool: Tool, arguments: dict[str, Any]) -> str | None:
    properties = tool.parameters.get("properties", {})
    required = tool.parameters.get("required", [])
    missing = [name for name in required if name not in arguments]
    unknown = [name for name in arguments if properties and name not in properties]
    if missing or unknown:
        return (f"tool '{tool.name}' takes {', '.join(properties) or 'no arguments'}"
                + (f"; missing: {', '.join(missing)}" if missing else "")
                + (f"; unknown: {', '.join(unknown)}" if unknown else ""))
    return None


async def _in_daemon_thread(fn: Callable[..., Any], arguments: dict[str, Any]) -> Any:
    """``fn(**arguments)`` in a daemon thread: a tool that never returns must not keep the
    orchestrator process alive at exit (``asyncio.to_thread``'s pool would be joined)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(outcome: Any, error: BaseException | None) -> None:
        if future.done():
            return  # timed out already
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(outcome)

    def work() -> None:
        try:
            outcome, error = fn(**arguments), None
        except BaseException as exc:  # noqa: BLE001 - reported as the tool's error turn
            outcome, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, outcome, error)
        except RuntimeError:
            pass  # the loop is closed: nobody waits any more

    threading.Thread(target=work, name=f"tool-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return await future


async def run_call(call: ToolCall, tools: dict[str, Tool], *, timeout: float) -> str:
    """The result text of ``call``; raises ``ToolError`` with the text of the error turn."""
    if call.error:
        raise ToolError(f"could not parse the tool call: {call.error}")
    tool = tools.get(call.name)
    if tool is None:
        raise ToolError(f"unknown tool '{call.name}'; available: {', '.join(tools) or 'none'}")
    if not isinstance(call.arguments, dict):
        raise ToolError(f"the arguments of '{call.name}' must be a JSON object")
    problem = _missing_or_unknown(tool, call.arguments)
    if problem:
        raise ToolError(problem)
    try:
        if inspect.iscoroutinefunction(tool.fn):
            result = await asyncio.wait_for(tool.fn(**call.arguments), timeout)
        else:
            result = await asyncio.wait_for(_in_daemon_thread(tool.fn, call.arguments), timeout)
    except TimeoutError:
        raise ToolError(f"tool '{call.name}' timed out after {timeout:g} s") from None
    except Exception as exc:
        raise ToolError(f"tool '{call.name}' failed: {type(exc).__name__}: {exc}") from None
    return result if isinstance(result, str) else json.dumps(result) if isinstance(result, dict | list) else str(result)
