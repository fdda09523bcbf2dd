"""prime-plugin-compile: compiled blocks (with FSDP on 2 gloo processes) match a single eager
process over several steps (the parallel-strategy contract suite)."""

import pytest

import prime_plugin_compile.plugin as plugin
from prime_core import PLUGIN_API_VERSION
from prime_core.testing.contracts.parallel_strategy import ParallelStrategyContract


def test_declares_the_plugin_api():
    assert plugin.PRIME_PLUGIN_API == PLUGIN_API_VERSION


@pytest.mark.slow
class TestCompile(ParallelStrategyContract):
    name = "compile"
    resume = False  # compiling changes no parameter: the fsdp suite checks resuming
    cases = [{"name": "compile", "model": {"impl": "hf", "compile": {}}},
             {"name": "compile_ac", "model": {"impl": "hf", "compile": {}, "ac": {"freq": 1}}}]
