"""The docs that are generated from code, and the README's promises, stay true."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _plugin_docs():
    spec = importlib.util.spec_from_file_location("plugin_docs", ROOT / "scripts" / "plugin_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hook_reference_is_current():
    docs = _plugin_docs()
    assert docs.current() == docs.reference().strip(), "run: python scripts/plugin_docs.py --write"


def test_plugin_index_is_current():
    spec = importlib.util.spec_from_file_location("plugin_index", ROOT / "scripts" / "plugin_index.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    current = (ROOT / "prime_core" / "plugin_index.json").read_text()
    assert current == module.render(), "run: python scripts/plugin_index.py --write"


def test_every_first_party_plugin_is_a_complete_distribution():
    folders = sorted(p.parent for p in ROOT.glob("plugins/*/*/pyproject.toml"))
    assert len(folders) >= 10
    for folder in folders:
        text = (folder / "pyproject.toml").read_text()
        assert '[project.entry-points."prime.plugins"]' in text, folder
        assert (folder / "README.md").is_file(), folder
        assert any((folder / "tests").glob("test_*.py")), folder
        assert 'name = "prime-plugin-' in text, folder
