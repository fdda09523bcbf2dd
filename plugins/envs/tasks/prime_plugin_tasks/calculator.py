"""Multi-digit arithmetic with a calculator tool: the policy may call ``calculator`` with an
expression and answer with its result. Reward: 1.0 when the final answer is the exact value,
else 0.0. A model too small to add three-digit numbers in its head gets these right only by
calling the tool and copying its result, so the tool is what RL has to learn to use.

Multi-turn: the episode runs until the model answers without a tool call, or ``max_turns``.
"""

from __future__ import annotations

import ast
import operator
import random

from prime_core.orchestrator.env import Task
from prime_core.orchestrator.tools import Tool

SYSTEM = "Reply with the number. Tool: calculator."
OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_AST = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate(expression: str) -> int:
    """The value of an integer expression of ``+``, ``-``, ``*`` and parentheses (nothing else
    is evaluated: no names, calls or attributes)."""
    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _AST:
            return _AST[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        raise ValueError(f"only integers, +, -, * and parentheses are allowed: {expression!r:.100}")

    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r:.100}") from None
    return walk(tree)


def calculator(expression: str) -> str:
    return str(evaluate(str(expression)))


TOOL = Tool(name="calculator", fn=calculator, description="Evaluate an integer expression with + - * and ( ).",
            parameters={"type": "object", "properties": {"expression": {"type": "string",
                                                                          "description": "e.g. 482+917"}},
                        "required": ["expression"]})


class Calculator:
    def __init__(self, digits: int = 3, operations: str = "+") -> None:
        if digits < 1 or digits > 9:
            raise ValueError(f"calculator: digits must be between 1 and 9, got {digits}")
        unknown = set(operations) - set(OPERATORS)
        if not operations or unknown:
            raise ValueError(f"calculator: operations must be some of '+-*', got {operations!r}")
        self.digits, self.operations = digits, operations
        self.tools = [TOOL]

    def tasks(self, rng: random.Random, n: int) -> list[Task]:
        out = []
        low = 10 ** (self.digits - 1) if self.digits > 1 else 0
        for _ in range(n):
            a, b = rng.randrange(low, 10 ** self.digits), rng.randrange(low, 10 ** self.digits)
            op = rng.choice(self.operations)
            expression = f"{a}{op}{b}"
            out.append(Task(prompt=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": expression}],
                            answer=str(OPERATORS[op](a, b)), info={"expression": expression}))
        return out

    def score(self, task: Task, completion: str) -> float:
        return 1.0 if completion.strip() == task.answer else 0.0

    def demonstration(self, task: Task, format_calls) -> list[dict]:
        """The conversation of a policy that uses the tool (for SFT warm-up data)."""
        from prime_core.orchestrator.tools import ToolCall

        call = format_calls([ToolCall(name="calculator", arguments={"expression": task.info["expression"]})])
        return [*task.prompt, {"role": "assistant", "content": call},
                {"role": "tool", "content": calculator(task.info["expression"])},
                {"role": "assistant", "content": task.answer}]
