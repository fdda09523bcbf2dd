"""prime-plugin-compile: compiled blocks (with FSDP on 2 gloo processes) match a single eager
process over several steps."""

import pytest

from prime_core import PLUGIN_API_VERSION
from prime_core.parity import TINY, check

import prime_plugin_compile.plugin as plugin

CASES = [{"name": "compile", "model": {"impl": "hf", "compile": {}}},
         {"name": "compile_ac", "model": {"impl": "hf", "compile": {}, "ac": {"freq": 1}}}]


def test_declares_the_plugin_api():
    assert plugin.PRIME_PLUGIN_API == PLUGIN_API_VERSION


@pytest.mark.slow
def test_compiled_training_matches_eager(tmp_path):
    from prime_plugin_hf.tiny import build_tiny

    results = check(build_tiny(tmp_path / "tiny", **TINY), tmp_path / "out", CASES, processes=2)
    for result in results.values():
        assert "compile" in result["applied"]
