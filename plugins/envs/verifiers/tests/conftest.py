"""Small verifiers tasksets written by the tests as installed packages would be (a module on
``sys.path`` exporting its ``Taskset`` subclass in ``__all__``, found by verifiers' own loader):
real ``verifiers.v1`` code, no network.

- ``prime-vf-reverse``: reverse a few words; two weighted rewards and a metric.
- ``prime-vf-tools``: the same with a calculator toolset (needs a multi-turn harness).
- ``prime-vf-sandboxed``: a reward that reads the runtime (needs a sandbox).
- ``prime-vf-endless``: an infinite taskset.
"""

from __future__ import annotations

import sys
import textwrap

import pytest

REVERSE = textwrap.dedent('''
    import difflib
    import itertools

    import verifiers.v1 as vf

    WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]


    class ReverseData(vf.TaskData):
        answer: str


    class ReverseTask(vf.Task[ReverseData, vf.State, vf.TaskConfig]):
        @vf.reward(weight=0.75)
        async def similarity(self, task: ReverseData, trace: vf.Trace) -> float:
            return difflib.SequenceMatcher(None, trace.last_reply, task.answer).ratio()

        @vf.reward(weight=0.25)
        async def exact(self, task: ReverseData, trace: vf.Trace) -> float:
            return float(trace.last_reply == task.answer)

        @vf.metric
        async def length(self, trace: vf.Trace) -> float:
            return float(len(trace.last_reply))


    class ReverseConfig(vf.TasksetConfig):
        count: int = 12
        words: int = 2


    class ReverseTaskset(vf.Taskset[ReverseTask, ReverseConfig]):
        def load(self):
            for i in range(self.config.count):
                text = " ".join(WORDS[(5 * i + 3 * j) % len(WORDS)] for j in range(self.config.words))
                yield ReverseTask(ReverseData(prompt=f"Reverse this text: {text}", answer=text[::-1],
                                              system_prompt="Reply with the reversed text only."), self.config.task)


    __all__ = ["ReverseTaskset"]
''')

TOOLS = textwrap.dedent('''
    import verifiers.v1 as vf
    from prime_vf_reverse import ReverseConfig, ReverseTask, ReverseTaskset


    class Calculator(vf.Toolset):
        @vf.tool
        async def add(self, a: int, b: int) -> int:
            """Add two integers."""
            return a + b


    class ToolTaskset(ReverseTaskset):
        @classmethod
        def toolsets(cls, config):
            return [Calculator(vf.ToolsetConfig())]


    __all__ = ["ToolTaskset"]
''')

SANDBOXED = textwrap.dedent('''
    import verifiers.v1 as vf
    from prime_vf_reverse import ReverseConfig, ReverseData, ReverseTask


    class FileTask(ReverseTask):
        @vf.reward
        async def wrote_file(self, runtime: vf.Runtime) -> float:
            return float(bool(await runtime.read("/tmp/answer.txt")))


    class FileTaskset(vf.Taskset[FileTask, ReverseConfig]):
        def load(self):
            yield FileTask(ReverseData(prompt="Write the answer to /tmp/answer.txt", answer="x"), self.config.task)


    __all__ = ["FileTaskset"]
''')

ENDLESS = textwrap.dedent('''
    import itertools

    import verifiers.v1 as vf
    from prime_vf_reverse import ReverseConfig, ReverseData, ReverseTask


    class EndlessTaskset(vf.Taskset[ReverseTask, ReverseConfig]):
        INFINITE = True

        def load(self):
            for i in itertools.count():
                yield ReverseTask(ReverseData(prompt=f"Reverse: {i}", answer=str(i)[::-1]), self.config.task)


    __all__ = ["EndlessTaskset"]
''')


@pytest.fixture(scope="session", autouse=True)
def tasksets(tmp_path_factory):
    """The tasksets above, importable as installed packages for the whole session."""
    root = tmp_path_factory.mktemp("tasksets")
    for name, source in {"prime_vf_reverse": REVERSE, "prime_vf_tools": TOOLS, "prime_vf_sandboxed": SANDBOXED,
                         "prime_vf_endless": ENDLESS}.items():
        (root / name).mkdir()
        (root / name / "__init__.py").write_text(source)
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))
