"""The ``hermes`` tool parser (the core's default): Hermes / Qwen3 tool calls, each a JSON object
``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``::

    Let me compute it.
    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12*34"}}
    </tool_call>

Qwen2.5, Qwen3, Hermes 2/3 and most models trained on their data write calls this way (vLLM's
``--tool-call-parser hermes`` reads the same). A tag that is opened and never closed, JSON that
does not parse, or an object without a string ``name`` becomes a ``ToolCall`` with ``error``
set, so the episode answers it with an error turn.
"""

from __future__ import annotations

import json
import re

from prime_core.orchestrator.tools import ParsedTurn, ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


def _read(body: str, index: int) -> ToolCall:
    call_id = f"call_{index}"
    try:
        data = json.loads(body)
    except ValueError as exc:
        return ToolCall(name="", id=call_id,
                        error=f"not valid JSON ({exc.msg} at char {exc.pos}): {body.strip()[:200]}")
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return ToolCall(name="", id=call_id, error='expected {"name": "...", "arguments": {...}}, got '
                                                  f"{body.strip()[:200]}")
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return ToolCall(name=data["name"], id=call_id, error=f"arguments are not a JSON object: {arguments[:200]}")
    if not isinstance(arguments, dict):
        return ToolCall(name=data["name"], id=call_id, error=f"arguments must be a JSON object, got {arguments!r:.200}")
    return ToolCall(name=data["name"], arguments=arguments, id=call_id)


def parse(text: str) -> ParsedTurn:
    calls, content, end = [], [], 0
    for index, match in enumerate(_CALL.finditer(text)):
        content.append(text[end:match.start()])
        end = match.end()
        closed = match.group(0).endswith(CLOSE)
        call = _read(match.group(1), index)
        if not closed and call.error is None:
            call = ToolCall(name=call.name, arguments=call.arguments, id=call.id,
                            error=f"{OPEN} is not closed with {CLOSE}")
        calls.append(call)
    content.append(text[end:])
    return ParsedTurn(content="".join(content).strip() if calls else text, tool_calls=calls)


def format_calls(calls: list[ToolCall]) -> str:
    """The text a model writes for ``calls`` (what ``parse`` reads back)."""
    return "\n".join(f"{OPEN}\n{json.dumps({'name': c.name, 'arguments': c.arguments})}\n{CLOSE}" for c in calls)
