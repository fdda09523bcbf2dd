"""prime-plugin-compile: compiled blocks (with FSDP on 2 gloo processes) match a single eager
process over several steps."""

import pytest

from prime_core import PLUGIN_API_VERSION
from prime_core.parity import compare, run

import prime_plugin_compile.plugin as plugin

CASES = [{"name": "compile", "model": {"compile": {}}},
         {"name": "compile_ac", "model": {"compile": {}, "ac": {"freq": 1}}}]


def test_declares_the_plugin_api():
    assert plugin.PRIME_PLUGIN_API == PLUGIN_API_VERSION


@pytest.mark.slow
def test_compiled_training_matches_eager(tmp_path):
    import torch
    from prime_plugin_hf.tiny import build_tiny

    tiny = build_tiny(tmp_path / "tiny", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32)
    run(tiny, tmp_path / "out", CASES, reference=True)
    run(tiny, tmp_path / "out", CASES, processes=2)
    for case in CASES:
        compare(tmp_path / "out" / f"{case['name']}.reference.pt", tmp_path / "out" / f"{case['name']}.pt")
        applied = torch.load(tmp_path / "out" / f"{case['name']}.pt", weights_only=False)["applied"]
        assert "compile" in applied
