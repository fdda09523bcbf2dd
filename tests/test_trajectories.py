"""Trajectories, episodes, tools and eval maths without a server: the prefix property keeps a
multi-turn conversation one sample, a template that breaks it splits the sample (each part
exact), interleaved masks reach the packed rows, tools fail into error turns, limits end
episodes, and pass@k is the unbiased estimator. The sampler is ``ScriptedPolicy``; real vLLM
is in ``test_agentic_e2e.py``."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest

from prime_core.orchestrator.batch import MicroBatch, pack
from prime_core.orchestrator.env import Task
from prime_core.orchestrator.episode import Episode, Limits, run_episode
from prime_core.orchestrator.eval import pass_at_k, summarize
from prime_core.orchestrator.hermes import format_calls, parse
from prime_core.orchestrator.tools import Tool, ToolCall
from prime_core.testing.chat import CHATML, ScriptedPolicy, chat_tokenizer

TASK = Task(prompt=[{"role": "user", "content": "12*3?"}], answer="36")


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer()


def episode(tokenizer, script, tools=(), **limits):
    policy = ScriptedPolicy(tokenizer, script)
    limits = {"max_turns": 4, "max_tokens": 1024, **limits}
    return Episode(task=TASK, sampler=policy, tokenizer=tokenizer, parse=parse, limits=Limits(**limits),
                   tools=list(tools), session_id="s"), policy


def calc(expression):
    return str(eval(expression, {}))  # noqa: S307 - the test's own expressions


CALC = Tool(name="calc", fn=calc, parameters={"type": "object", "properties": {"expression": {"type": "string"}},
                                              "required": ["expression"]})


class Env:
    tools = [CALC]

    def tasks(self, rng, n):
        return [TASK] * n

    def score(self, task, completion):
        return float(completion.strip() == task.answer)


def sampled(trajectory):
    return [(t, lp) for seg in trajectory.segments for t, m, lp in zip(seg.ids, seg.mask, seg.logprobs, strict=True)
            if m]


def played(policy):
    return [(t, lp) for s in policy.samples for t, lp in zip(s.token_ids, s.logprobs, strict=True)]


def test_a_tool_conversation_is_one_exact_sample(tokenizer):
    call = format_calls([ToolCall(name="calc", arguments={"expression": "12*3"})])
    ep, policy = episode(tokenizer, [call, "36"], tools=[CALC])
    outcome = asyncio.run(run_episode(Env(), TASK, ep))
    assert (outcome.reward, outcome.error, ep.turns, ep.trajectory.splits) == (1.0, None, 2, 0)
    assert [m["role"] for m in ep.messages] == ["user", "assistant", "tool", "assistant"]
    assert ep.messages[2]["content"] == "36"
    assert sampled(ep.trajectory) == played(policy)
    (sample,) = ep.trajectory.samples(advantage=0.5, reward=1.0, version=3)
    full = sample.prompt_ids + sample.completion_ids
    assert full == tokenizer.apply_chat_template(ep.messages, tokenize=True)["input_ids"][:len(full)]
    # Mask 1 on both model turns, 0 on the tool turn between them.
    text = tokenizer.decode([t for t, m in zip(sample.completion_ids, sample.mask, strict=True) if not m])
    assert text == "\n<|im_start|>tool\n36<|im_end|>\n<|im_start|>assistant\n"
    row = MicroBatch()
    row.add(sample)
    assert row.loss_mask == [0] * len(sample.prompt_ids) + sample.mask
    assert row.advantages == [0.0] * len(sample.prompt_ids) + [0.5 * m for m in sample.mask]
    logprobs = [lp for lp, m in zip(row.inference_logprobs, row.loss_mask, strict=True) if m]
    assert logprobs == [lp for s in policy.samples for lp in s.logprobs]
    # Cut to seq_len, the mask is cut with the tokens.
    (cut,) = pack([sample], len(sample.prompt_ids) + 5)
    assert cut.loss_mask[-5:] == sample.mask[:5]


def test_a_template_that_breaks_the_prefix_splits_the_sample(tokenizer):
    """A template that drops earlier reasoning (as Qwen3's does) makes each turn its own sample."""
    tokenizer = chat_tokenizer()
    tokenizer.chat_template = CHATML.replace(
        "message['content']", "(message['content'].split('</think>')[-1] if message['role'] == 'assistant' "
                              "and not loop.last else message['content'])")
    call = format_calls([ToolCall(name="calc", arguments={"expression": "2*3"})])
    ep, policy = episode(tokenizer, ["<think>hmm</think>" + call, "6"], tools=[CALC])
    outcome = asyncio.run(run_episode(Env(), TASK, ep))
    assert outcome.error is None and ep.trajectory.splits == 1
    samples = ep.trajectory.samples(advantage=1.0, reward=0.0, version=0)
    assert len(samples) == 2
    assert sampled(ep.trajectory) == played(policy)
    second = samples[1]
    assert "<think>" not in tokenizer.decode(second.prompt_ids), "the second sample starts from the fresh rendering"
    assert second.completion_ids == policy.samples[1].token_ids


def test_tool_faults_are_error_turns(tokenizer):
    def hang(expression):
        time.sleep(30)

    def boom(expression):
        raise KeyError("no")

    tools = [CALC, Tool(name="hang", fn=hang), Tool(name="boom", fn=boom)]
    script = [format_calls([ToolCall(name="nope", arguments={})]),
              "<tool_call>\n{\"name\": \"calc\", \"arguments\": {\"expression\": \"1+\n</tool_call>",
              format_calls([ToolCall(name="calc", arguments={"x": 1})]),
              format_calls([ToolCall(name="hang", arguments={"expression": "1"}),
                            ToolCall(name="boom", arguments={"expression": "1"})])]
    ep, _ = episode(tokenizer, script, tools=tools, max_turns=4, tool_timeout=0.5)
    started = time.monotonic()
    outcome = asyncio.run(run_episode(Env(), TASK, ep))
    assert time.monotonic() - started < 5
    assert outcome.error is None and outcome.reward == 0.0 and ep.stop_reason == "max_turns"
    errors = [m["content"] for m in ep.messages if m["role"] == "tool"]
    assert errors[0].startswith("error: unknown tool 'nope'; available: calc, hang, boom")
    assert errors[1].startswith("error: could not parse the tool call: not valid JSON")
    assert errors[2] == "error: tool 'calc' takes expression; missing: expression; unknown: x"
    assert errors[3:] == ["error: tool 'hang' timed out after 0.5 s", "error: tool 'boom' failed: KeyError: 'no'"]
    assert (ep.tool_calls, ep.tool_errors) == (5, 5)
    assert any(t.name == "tool-hang" and t.daemon for t in threading.enumerate()), "the hung tool cannot block exit"


def test_limits_end_the_episode(tokenizer):
    class Chatty(Env):
        tools = []

        def respond(self, task, messages, state):
            return {"role": "user", "content": "more"}

    ep, _ = episode(tokenizer, ["x" * 10], max_turns=3)
    asyncio.run(run_episode(Chatty(), TASK, ep))
    assert (ep.turns, ep.stop_reason) == (3, "max_turns")
    ep, policy = episode(tokenizer, ["y" * 40], max_turns=10, max_tokens=80)
    asyncio.run(run_episode(Chatty(), TASK, ep))
    assert ep.stop_reason == "max_tokens"
    assert all(len(s) <= 80 for s in ep.trajectory.samples(advantage=0.0, reward=0.0, version=0))
    assert all(r.max_tokens <= 80 - len(r.prompt_ids) for r in policy.requests)


def test_an_environment_that_raises_fails_its_rollout_only(tokenizer):
    class Broken(Env):
        def score(self, task, completion):
            raise ZeroDivisionError("bad rubric")

    ep, _ = episode(tokenizer, ["36"])
    outcome = asyncio.run(run_episode(Broken(), TASK, ep))
    assert outcome.reward is None and outcome.error.startswith("ZeroDivisionError: bad rubric")

    class NaN(Env):
        def score(self, task, completion):
            return math.nan

    ep, _ = episode(tokenizer, ["36"])
    assert "not a finite number" in asyncio.run(run_episode(NaN(), TASK, ep)).error


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 4) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - (3 * 2) / (4 * 3))  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(5, 2, 5) == 1.0
    metrics = summarize([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.5, 0.0, 0.0, 0.0]])
    assert metrics["avg@4"] == pytest.approx(5.5 / 12)
    assert metrics["pass@1"] == pytest.approx((0.25 + 1 + 0) / 3)
    assert metrics["pass@4"] == pytest.approx(2 / 3)
    assert set(metrics) == {"avg@4", "pass@1", "pass@2", "pass@4"}
    assert set(summarize([[1.0] * 6])) == {"avg@6", "pass@1", "pass@2", "pass@4", "pass@6"}
