"""A verifiers taskset as a prime environment.

verifiers (0.4, ``verifiers.v1``) splits an environment into a taskset (the tasks: prompt data
and ``@vf.reward`` / ``@vf.metric`` methods), a harness (the program that talks to the model,
run by a runtime) and an env (how agents meet a task). prime keeps the first and replaces the
other two with its own single-turn rollout: the prompt is the task's system prompt and prompt,
as verifiers' ``null`` harness sends them; the policy's completion becomes the one assistant
turn of a verifiers ``Trace``; and the task's own ``score`` runs on that trace, its weighted
rewards summed as verifiers sums them (``Trace.reward``).
"""

from __future__ import annotations

import asyncio
import random
import time

from prime_core.orchestrator.env import Task
from prime_plugin_verifiers.args import VerifiersArgs


class VerifiersEnv:
    def __init__(self, args: VerifiersArgs) -> None:
        from verifiers.v1.trace import _current_build

        cls, config = args.resolved()
        taskset = cls(config)
        if not taskset.bounded and args.limit is None:
            raise ValueError(f"limit: verifiers taskset '{config.id}' is infinite; set limit to the number of tasks "
                             "to draw from")
        self.name = config.id
        self.tasks_ = list(taskset.take(args.limit) if args.limit else taskset)
        if not self.tasks_:
            raise ValueError(f"taskset: verifiers taskset '{config.id}' yields no tasks")
        self.prompts = [prompt_messages(task, self.name) for task in self.tasks_]
        _check_rewards(self.tasks_[0], self.name)
        self.answer_field = args.answer_field
        if self.answer_field is not None and not hasattr(self.tasks_[0].data, self.answer_field):
            raise ValueError(f"answer_field: the tasks of '{self.name}' have no field '{self.answer_field}'; they have "
                             f"{', '.join(type(self.tasks_[0].data).model_fields)}")
        self.build = _current_build()  # once: it may ask git

    def tasks(self, rng: random.Random, n: int) -> list[Task]:
        out = []
        for _ in range(n):
            index = rng.randrange(len(self.tasks_))
            task = self.tasks_[index]
            answer = getattr(task.data, self.answer_field) if self.answer_field else None
            out.append(Task(prompt=[dict(m) for m in self.prompts[index][1]],
                            answer=None if answer is None else str(answer),
                            info={"taskset": self.name, "index": index, "key": task.key}))
        return out

    def score(self, task: Task, completion: str) -> float:
        # A worker thread of the orchestrator: no event loop runs here, so the task's async
        # rewards get one of their own.
        return asyncio.run(self._score(self.tasks_[task.info["index"]], self.prompts[task.info["index"]][0],
                                       completion))

    async def _score(self, task, prompt, completion: str) -> float:
        import verifiers.v1 as vf
        from verifiers.v1.graph import prepare_turn
        from verifiers.v1.state import state_cls

        trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                         state=state_cls(type(task))(), agent=vf.AgentInfo(config=vf.AgentConfig(), name="prime"),
                         verifiers=self.build)
        reply = vf.Response(id=f"prime-{task.key[:16]}", created=int(time.time()), model="prime",
                            message=vf.AssistantMessage(content=completion), finish_reason="stop")
        prepare_turn(trace, prompt).commit(reply)
        trace.is_completed = trace.ok = True
        try:
            await task.score(trace)
        except Exception as exc:
            raise RuntimeError(f"verifiers taskset '{self.name}': scoring task {task.data.idx} failed: "
                               f"{type(exc).__name__}: {exc}") from exc
        return float(trace.reward)


def prompt_messages(task, taskset: str) -> tuple[list, list[dict[str, str]]]:
    """The task's opening messages, as verifiers messages and as prime's chat dicts."""
    import verifiers.v1 as vf

    data = task.data
    where = f"verifiers taskset '{taskset}', task {data.idx}"
    if data.prompt is None:
        raise ValueError(f"{where} has no prompt (the user opens the conversation): that needs a multi-turn harness")
    messages = [vf.UserMessage(content=data.prompt)] if isinstance(data.prompt, str) else list(data.prompt)
    if data.system_prompt is not None:  # as verifiers' null harness places it: a system turn first
        messages.insert(0, vf.SystemMessage(content=data.system_prompt))
    chat = []
    for message in messages:
        if not isinstance(message.content, str) or getattr(message, "tool_calls", None) or message.role == "tool":
            raise ValueError(f"{where}: its prompt holds images or tool calls, which prime's text-only single-turn "
                             "rollouts cannot give the model")
        chat.append({"role": message.role, "content": message.content})
    if chat[-1]["role"] == "assistant":
        raise ValueError(f"{where}: its prompt ends with an assistant turn; the policy writes the next one")
    return messages, chat


def _check_rewards(task, taskset: str) -> None:
    """Rewards and metrics that need a runtime (a sandbox) would be skipped without one, and the
    reward would silently mean something else: refuse them."""
    import inspect

    needs = [fn.__name__ for kind in ("reward", "metric") for fn in task.hooks(kind)
             if (p := inspect.signature(fn).parameters.get("runtime")) is not None and p.default is p.empty]
    if needs:
        raise ValueError(f"taskset: verifiers taskset '{taskset}' scores with {', '.join(needs)}, which need a "
                         "runtime (sandbox) that prime's single-turn rollouts do not provide")
    if not task.hooks("reward"):
        raise ValueError(f"taskset: verifiers taskset '{taskset}' has no reward (@vf.reward) to train on")


def load(**args) -> VerifiersEnv:
    from pydantic import ValidationError

    try:
        validated = VerifiersArgs.model_validate(args, strict=True)
    except ValidationError as exc:  # the orchestrator reports it under orchestrator.env[i].args
        raise ValueError("; ".join(f"{'.'.join(map(str, e['loc'])) + ': ' if e['loc'] else ''}"
                                   f"{e['msg'].removeprefix('Value error, ')}" for e in exc.errors())) from None
    return VerifiersEnv(validated)
