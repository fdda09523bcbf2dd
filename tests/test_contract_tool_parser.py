"""The tool-parser contract suite: the core's hermes parser passes it; parsers that raise,
lose calls or drop malformed ones silently fail it."""

import json

import pytest

from prime_core.orchestrator.tools import ParsedTurn, ToolCall
from prime_core.specs import ToolParser
from prime_core.testing.contracts import ContractError
from prime_core.testing.contracts import tool_parser as contract
from prime_core.testing.contracts.tool_parser import ToolParserContract


class TestHermes(ToolParserContract):
    name = "hermes"
    plugin = "prime_core.builtin"


def test_hermes_reads_what_qwen3_writes():
    from prime_core.orchestrator.hermes import parse

    text = ('I will compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "calculator", "arguments": "{\\"expression\\": \\"4\\"}"}\n</tool_call>')
    parsed = parse(text)
    assert parsed.content == "I will compute."
    assert [(c.name, c.arguments, c.error) for c in parsed.tool_calls] == [
        ("calculator", {"expression": "2*3"}, None), ("calculator", {"expression": "4"}, None)]
    unclosed = parse('<tool_call>\n{"name": "calculator", "arguments": {}}')
    assert unclosed.tool_calls[0].error == "<tool_call> is not closed with </tool_call>"
    bad = parse("<tool_call>{nope}</tool_call>").tool_calls[0]
    assert bad.error.startswith("not valid JSON")


def _spec(parse, fmt=None):
    def default_format(calls):
        return "\n".join(json.dumps({"tool": c.name, "args": c.arguments}) for c in calls)
    return ToolParser(name="broken", parse=parse, format=fmt or default_format)


def _json_lines(text):
    calls, content = [], []
    for line in text.splitlines():
        try:
            data = json.loads(line)
        except ValueError:
            data = None
        if isinstance(data, dict) and "tool" in data:
            calls.append(ToolCall(name=data["tool"], arguments=data["args"]))
        else:
            content.append(line)
    return ParsedTurn(content="\n".join(content) if calls else text, tool_calls=calls)


def test_a_json_lines_parser_passes_the_round_trip():
    contract.check_round_trip(_spec(_json_lines))
    contract.check_garbage(_spec(_json_lines))


@pytest.mark.parametrize(("parse", "check", "message"), [
    (lambda text: ParsedTurn(content=text, tool_calls=[ToolCall(**json.loads(text))]), contract.check_garbage,
     "raised"),
    (lambda text: ParsedTurn(content=text), contract.check_round_trip, "not the calls"),
    (lambda text: {"content": text}, contract.check_plain_text, "not prime_core.orchestrator.tools.ParsedTurn"),
    (lambda text: ParsedTurn(content=text), lambda spec: contract.check_malformed_calls_have_errors(
        spec, ToolParserContract.malformed), "holds a malformed call"),
])
def test_broken_parsers_fail_the_suite(parse, check, message):
    with pytest.raises(ContractError, match=message):
        check(_spec(parse))
