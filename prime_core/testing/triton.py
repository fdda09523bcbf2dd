"""Testing Triton kernels where there is no GPU: a test file marks its kernel tests with
``kernel_test`` and defines ``test_in_the_triton_interpreter = interpreter_rerun(__file__)``.
Without CUDA that one test reruns the whole file in a fresh process under
``TRITON_INTERPRET=1``; the switch must be set before triton is first imported, hence the
fresh process. So the kernels' arithmetic is checked everywhere, and their compiled code where
a GPU exists."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def runs_kernels() -> bool:
    """Whether Triton kernels run in this process: a CUDA GPU, or the interpreter switched on."""
    import torch

    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


kernel_test = pytest.mark.skipif(not runs_kernels(), reason="run in the interpreter by test_in_the_triton_interpreter")


def interpreter_rerun(path: str, keyword: str | None = None):
    """The test that reruns ``path`` under Triton's interpreter (skipped where kernels run); only
    its tests matching ``keyword`` (pytest's ``-k``) where given."""

    @pytest.mark.skipif(runs_kernels(), reason="the kernels run in this process")
    def test_in_the_triton_interpreter():
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        select = ["-k", keyword] if keyword else []
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *select, path],
                                env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
        assert " passed" in result.stdout

    return test_in_the_triton_interpreter
