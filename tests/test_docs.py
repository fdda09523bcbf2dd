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


def _doc_examples() -> dict[str, str]:
    """The complete example plugins of docs/plugins.md, by module (``prime_plugin_echo``)."""
    import re

    text = (ROOT / "docs" / "plugins.md").read_text()
    blocks = re.findall(r"```python\n# (prime_plugin_\w+)/plugin\.py[^\n]*\n(.*?)```", text, re.DOTALL)
    return dict(blocks)


def test_the_example_plugins_of_every_kind_meet_their_contracts(tmp_path, monkeypatch):
    """Each kind's example in docs/plugins.md, run through its contract suite's checks."""
    import random
    import types

    from prime_core.plugins import set_plugin_manager
    from prime_core.testing.contracts import (
        algorithm,
        environment,
        kernel,
        launcher,
        manager_for,
        model_impl,
        monitor,
        spec_from,
        tool_parser,
        weight_transport,
    )

    examples = _doc_examples()
    assert set(examples) == {"prime_plugin_widget", "prime_plugin_echo", "prime_plugin_stepfile",
                             "prime_plugin_here", "prime_plugin_silu", "prime_plugin_tf", "prime_plugin_copies",
                             "prime_plugin_zscore", "prime_plugin_brackets"}
    monkeypatch.chdir(tmp_path)

    def load(name: str, registry: str, key: str):
        module = types.ModuleType(f"{name}.plugin")
        exec(compile(examples[name], f"docs/plugins.md:{name}", "exec"), module.__dict__)  # noqa: S102
        manager = manager_for(module)
        set_plugin_manager(manager)
        return spec_from(manager, registry, key)

    try:
        spec = load("prime_plugin_echo", "environments", "echo")
        env = environment.load_env(spec, {"words": 2})
        environment.check_scores(env, environment.check_tasks(env))
        environment.check_args(spec, {"words": 2})
        environment.check_unknown_arg_refused(spec, {})
        environment.check_prompts(env.tasks(random.Random(0), 3))

        monitor.check_roles(load("prime_plugin_stepfile", "monitors", "stepfile"), tmp_path / "mon", tmp_path)

        spec = load("prime_plugin_here", "launchers", "here")
        for root in ("rl", "sft", "inference"):
            out = tmp_path / f"launch-{root}"
            config = launcher.root_config(root, out, "here")
            plan, _ = launcher.make_plan(spec, config, root, out, tmp_path)
            launcher.check_plan(spec, plan, config, root, out)
        launcher.check_launch(spec, tmp_path / "launched")

        kernel.check_kernel(load("prime_plugin_silu", "kernels", "swiglu:silu"), device="cpu")

        folder = model_impl.tiny_checkpoint(tmp_path / "tiny")
        spec = load("prime_plugin_tf", "model_impls", "tf")
        model_impl.check_parity(spec, model_impl.model_config(folder, "tf"), folder, tmp_path / "grads")

        spec = load("prime_plugin_copies", "weight_transports", "copies")
        model = weight_transport.tiny_model(tmp_path / "published-model")
        weight_transport.check_versions(spec, model, tmp_path / "wt", tmp_path / "scratch", other_process=False)

        algorithm.check_advantage(load("prime_plugin_zscore", "algorithms", "advantage:zscore"))

        spec = load("prime_plugin_brackets", "tool_parsers", "brackets")
        tool_parser.check_round_trip(spec)
        tool_parser.check_plain_text(spec)
        tool_parser.check_garbage(spec)
        tool_parser.check_malformed_calls_have_errors(spec, ('[TOOL_CALLS] [{"name": "calculator", "arguments": {',
                                                             '[TOOL_CALLS] [{"arguments": {}}]'))
    finally:
        set_plugin_manager(None)
