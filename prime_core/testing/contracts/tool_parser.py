"""Contract suite for tool parsers (``prime_core.specs.ToolParser``).

The orchestrator calls ``spec.parse(text)`` on its event loop for every model turn of an
environment with tools, in training and in eval, and ``spec.format(calls)`` makes the text of
demonstrations (SFT data). This suite does the same::

    from prime_core.testing.contracts.tool_parser import ToolParserContract

    class TestMine(ToolParserContract):
        name = "mine"

It checks that ``format`` then ``parse`` gives the calls back (names, arguments, order; one
call or several, unicode and nested arguments); that text without calls comes back as the
content with no calls; that ``parse`` never raises on any text (truncated calls, bad JSON,
garbage, a huge string), answering what it cannot read with a ``ToolCall`` whose ``error``
says why; that it returns the core's ``ParsedTurn`` and ``ToolCall`` types; and that it is
quick (it runs on the event loop).
"""

from __future__ import annotations

import time

from prime_core.testing.contracts import Contract, ContractError, expect

CALLS = [
    [("calculator", {"expression": "482+917"})],
    [("search", {"query": "prime numbers", "limit": 3}), ("open", {"url": "https://example.org/a?b=1"})],
    [("echo", {"text": "ü → 中文 🙂 \"quoted\" \\ backslash\nnewline"})],
    [("nested", {"filters": {"tags": ["a", "b"], "range": [1, 2.5]}, "flag": True, "none": None})],
    [("no_args", {})],
]
PLAIN = ("", "42", "The answer is 7.", "no tools here\nat all", "ü → 中文 🙂", "{\"name\": \"x\"} is just JSON text")
GARBAGE = ("<tool_call>", "<tool_call>{", "<tool_call>{\"name\": 1}</tool_call>", "<tool_call>not json</tool_call>",
           "</tool_call>", "<tool_call>\n{\"arguments\": {}}\n</tool_call>", "<<<>>>{[(", "\x00\x01\x02",
           "<tool_call>" * 50, "a" * 20000, "<tool_call>{\"name\": \"calc\", \"arguments\": \"1+\"}</tool_call>")


def _types():
    from prime_core.orchestrator.tools import ParsedTurn, ToolCall

    return ParsedTurn, ToolCall


def parse(spec, text: str):
    parsed_type, call_type = _types()
    try:
        parsed = spec.parse(text)
    except Exception as exc:
        raise ContractError(f"tool parser '{spec.name}': parse({text!r:.60}) raised {type(exc).__name__}: {exc}; a "
                            "call it cannot read must come back as a ToolCall with error set") from exc
    expect(isinstance(parsed, parsed_type), f"tool parser '{spec.name}': parse() returned {type(parsed).__name__}, "
                                            "not prime_core.orchestrator.tools.ParsedTurn")
    expect(isinstance(parsed.content, str), f"tool parser '{spec.name}': ParsedTurn.content is not a string")
    for call in parsed.tool_calls:
        expect(isinstance(call, call_type), f"tool parser '{spec.name}': a tool call is a {type(call).__name__}, "
                                            "not prime_core.orchestrator.tools.ToolCall")
        expect(isinstance(call.name, str) and isinstance(call.arguments, dict),
               f"tool parser '{spec.name}': ToolCall needs a str name and a dict of arguments, got {call!r:.200}")
        expect(call.error is None or (isinstance(call.error, str) and call.error.strip()),
               f"tool parser '{spec.name}': ToolCall.error must be None or a reason, got {call.error!r}")
    return parsed


def check_round_trip(spec) -> None:
    _, call_type = _types()
    for calls in CALLS:
        objects = [call_type(name=name, arguments=arguments) for name, arguments in calls]
        text = spec.format(objects)
        expect(isinstance(text, str) and text, f"tool parser '{spec.name}': format() returned {text!r:.80}")
        for prefix in ("", "Let me use a tool.\n"):
            parsed = parse(spec, prefix + text)
            got = [(c.name, c.arguments, c.error) for c in parsed.tool_calls]
            expect(got == [(name, arguments, None) for name, arguments in calls],
                   f"tool parser '{spec.name}': parse(format(calls)) gave {got!r:.300}, not the calls {calls!r:.300}")
            if prefix:
                expect(prefix.strip() in parsed.content,
                       f"tool parser '{spec.name}': the text before the calls is lost ({parsed.content!r:.100})")


def check_plain_text(spec) -> None:
    for text in PLAIN:
        parsed = parse(spec, text)
        expect(not parsed.tool_calls, f"tool parser '{spec.name}': found calls in {text!r:.60}, which has none")
        expect(parsed.content.strip() == text.strip(),
               f"tool parser '{spec.name}': content of {text!r:.60} came back as {parsed.content!r:.60}")


def check_garbage(spec) -> None:
    for text in GARBAGE:
        started = time.perf_counter()
        parse(spec, text)
        expect(time.perf_counter() - started < 0.05,
               f"tool parser '{spec.name}': parse() took over 50 ms on {len(text)} characters (it runs on the "
               "orchestrator's event loop)")


def check_malformed_calls_have_errors(spec, texts: tuple[str, ...]) -> None:
    """Each of ``texts`` holds one call the parser's own format cannot read: it must come back
    as a call with ``error`` set (answered with an error turn), not be dropped silently."""
    for text in texts:
        calls = parse(spec, text).tool_calls
        expect(calls and all(c.error for c in calls),
               f"tool parser '{spec.name}': {text!r:.80} holds a malformed call, but parse() returned "
               f"{calls!r:.200}; return a ToolCall with error set so the policy is told")


class ToolParserContract(Contract):
    """Subclass with ``name`` set; ``malformed``: texts in the parser's format whose one call
    is unreadable (the default fits ``<tool_call>`` parsers; set ``()`` to skip)."""

    registry = "tool_parsers"
    malformed: tuple[str, ...] = (
        "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \n</tool_call>",
        "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {}}")

    def test_format_then_parse_gives_the_calls_back(self, spec):
        check_round_trip(spec)

    def test_text_without_calls_is_content(self, spec):
        check_plain_text(spec)

    def test_never_raises_and_is_quick(self, spec):
        check_garbage(spec)

    def test_malformed_calls_are_answered(self, spec):
        check_malformed_calls_have_errors(spec, self.malformed)
