"""What a warmed-up tool model does, exactly (teacher-forced log-probabilities, no sampling
noise), on 64 calculator tasks at temperature 1:

- ``p_call``: the probability that its first turn is the right calculator call;
- ``p_copy``: the probability that, given the tool's result, it answers with it;
- ``p_direct``: the probability that it answers right without the tool;
- ``expected_reward``: ``p_call * p_copy + p_direct`` (averaged per task), what RL starts from;
  ``p_copy`` is about where RL can take it by always calling the tool.

    python examples/tools/probe.py outputs/tools/sft/model
"""

from __future__ import annotations

import argparse
import json
import random
from statistics import mean


def probe(model_path, n: int = 64, seed: int = 123) -> dict:
    from prime_core.orchestrator.expected import answer_probabilities
    from prime_core.orchestrator.tools import ToolCall
    from prime_core.plugins import get_plugin_manager
    from prime_plugin_tasks.calculator import Calculator, calculator

    format_calls = get_plugin_manager().select("tool_parsers", "hermes", key="tool_parser").format
    chats = []  # per task: the right call, the answer after the tool's result, the direct answer
    for task in Calculator(digits=3, operations="+").tasks(random.Random(seed), n):
        expression = task.info["expression"]
        call = {"role": "assistant", "content": format_calls([ToolCall(name="calculator",
                                                                        arguments={"expression": expression})])}
        answer = {"role": "assistant", "content": task.answer}
        chats += [[*task.prompt, call], [*task.prompt, call, {"role": "tool", "content": calculator(expression)},
                                          answer], [*task.prompt, answer]]
    p = answer_probabilities(model_path, chats)
    rows = [p[i:i + 3] for i in range(0, len(p), 3)]
    return {"p_call": mean([r[0] for r in rows]), "p_copy": mean([r[1] for r in rows]),
            "p_direct": mean([r[2] for r in rows]), "expected_reward": mean([r[0] * r[1] + r[2] for r in rows])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a model folder (e.g. outputs/tools/sft/model)")
    parser.add_argument("--n", type=int, default=64, help="number of tasks")
    args = parser.parse_args()
    print(json.dumps({k: round(v, 4) for k, v in probe(args.model, args.n).items()}))


if __name__ == "__main__":
    main()
