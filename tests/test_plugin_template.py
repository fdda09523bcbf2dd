"""`prime plugin new` writes a plugin that installs, is listed, and whose hooks the core calls;
``--kind`` writes one of every kind that a config selects and that passes its contract suite."""

import importlib
import json
import os
import subprocess
import sys

import pytest


def test_new_plugin_installs_and_works(prime_cli, plugin_manager, tmp_path):
    result = prime_cli("plugin", "new", "my-widget", "--dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    project = tmp_path / "prime-plugin-my-widget"
    assert (project / "pyproject.toml").is_file() and (project / "prime_plugin_my_widget" / "plugin.py").is_file()

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(project)], check=True, capture_output=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    env.pop("PRIME_DISABLE_PLUGIN_AUTOLOAD", None)

    def prime(*args):
        return subprocess.run([sys.executable, "-m", "prime_core", *args], capture_output=True, text=True, env=env)

    listed = json.loads(prime("plugins", "list", "--json").stdout)
    row = next(p for p in listed["plugins"] if p["name"] == "my_widget")
    assert (row["status"], row["distribution"]) == ("active", "prime-plugin-my-widget")
    assert row["provides"]["cli_commands"][0]["name"] == "my_widget"
    assert row["provides"]["config_sections"][0]["name"] == "my_widget"

    assert prime("my_widget", "hello", "there").stdout.strip() == "hello there, from my_widget"
    shown = prime("config", "show", "--format", "json", "--my-widget.greeting", "hey")
    assert json.loads(shown.stdout)["my_widget"]["greeting"] == "hey"
    empty = prime("config", "validate", "--my-widget.greeting", " ")
    assert empty.returncode == 2 and "my_widget.greeting: must not be empty" in empty.stderr

    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(project / "tests")],
                           capture_output=True, text=True, env=env, cwd=tmp_path)
    assert tests.returncode == 0, tests.stdout + tests.stderr


KINDS = ("environment", "monitor", "launcher", "kernel", "model_impl", "weight_transport", "algorithm", "router",
         "inference_backend", "parallel_strategy")


def install_as_dist_info(project, site):
    """What ``pip install`` leaves for discovery: the package, and a ``.dist-info`` whose entry
    points are the ones the generated ``pyproject.toml`` declares."""
    import shutil
    import tomllib

    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    info = site / f"{meta['name'].replace('-', '_')}-{meta['version']}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n")
    points = meta["entry-points"]["prime.plugins"]
    (info / "entry_points.txt").write_text("[prime.plugins]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()))
    for package in project.glob("prime_plugin_*"):
        shutil.copytree(package, site / package.name)


@pytest.mark.slow  # ~2 min on 2 idle cores: ten generated plugins' own tests, contract suites included
def test_every_kind_is_listed_selected_and_passes_its_contract_suite(prime_cli, plugin_manager, tmp_path,
                                                                    monkeypatch):
    from prime_core.plugins import PluginManager, set_plugin_manager

    site = tmp_path / "site"
    for kind in KINDS:
        result = prime_cli("plugin", "new", f"my-{kind}", "--kind", kind, "--dir", str(tmp_path))
        assert result.exit_code == 0, result.output
        install_as_dist_info(tmp_path / f"prime-plugin-my-{kind.replace('_', '-')}", site)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    env.pop("PRIME_DISABLE_PLUGIN_AUTOLOAD", None)
    # The CLI in this process, discovering what the PYTHONPATH above shows a new one (the entry
    # points of site's .dist-info, read from sys.path): three `prime` processes importing torch
    # again were about 12 s of this test. The generated tests below run in a process of their own.
    monkeypatch.syspath_prepend(str(site))
    set_plugin_manager(PluginManager(autoload=True, disabled=()).load())
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # the default hub model may be downloaded by the roles (never here)
    try:
        check_the_kinds(prime_cli)
    finally:  # the generated plugins leave this process's modules as they found them
        for name in [m for m in sys.modules if m.startswith("prime_plugin_my_")]:
            del sys.modules[name]
        importlib.invalidate_caches()

    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=importlib",
                            *[str(p / "tests") for p in sorted(tmp_path.glob("prime-plugin-*"))]],
                           capture_output=True, text=True, env=env, cwd=tmp_path, check=False)
    assert tests.returncode == 0, tests.stdout[-5000:] + tests.stderr[-2000:]
    assert " failed" not in tests.stdout and " passed" in tests.stdout


def check_the_kinds(prime) -> None:
    """Every kind listed active and providing its name; all selected at once, a config that
    validates; a misspelt environment argument named with the right one."""
    listed = {p["name"]: p for p in json.loads(prime("plugins", "list", "--json").stdout)["plugins"]}
    keys = {"kernel": ("kernels", "swiglu:my_kernel"), "algorithm": ("algorithms", "advantage:my_algorithm"),
            "parallel_strategy": ("parallel_strategies", "my_parallel_strategy")}
    for kind in KINDS:
        row = listed[f"my_{kind}"]
        assert (row["status"], row["distribution"]) == ("active", f"prime-plugin-my-{kind.replace('_', '-')}")
        registry, key = keys.get(kind, (kind + "s", f"my_{kind}"))
        assert key in [spec["name"] for spec in row["provides"][registry]], row

    selected = ["--launcher", "my_launcher", "--trainer.model.impl", "my_model_impl",
                "--trainer.model.kernels", '{"swiglu": "my_kernel"}', "--weight-broadcast.type", "my_weight_transport",
                "--orchestrator.advantage.type", "my_algorithm", "--trainer.my-monitor.every", "2",
                "--orchestrator.client.router", "my_router", "--inference.backend", "my_inference_backend",
                "--trainer.model.my-parallel-strategy-every", "1",
                "--orchestrator.env", '[{"id": "my_environment", "args": {"min_len": 2}}]']
    valid = prime("config", "validate", *selected)
    assert valid.exit_code == 0, valid.stdout + valid.stderr
    bad = prime("config", "validate", *selected[:-1], '[{"id": "my_environment", "args": {"min_lne": 2}}]')
    assert bad.exit_code == 2 and "orchestrator.env[0].args.min_lne: environment 'my_environment' has no argument " \
        "'min_lne' (did you mean 'min_len'?)" in " ".join(bad.stderr.split())


def test_an_unknown_kind_is_refused(prime_cli, plugin_manager, tmp_path):
    result = prime_cli("plugin", "new", "thing", "--kind", "teapot", "--dir", str(tmp_path))
    assert result.exit_code == 1 and "--kind 'teapot' is not a plugin kind the template knows" in result.output
    assert not (tmp_path / "prime-plugin-thing").exists()


@pytest.mark.parametrize("name", ["Bad", "9lives", "a b", "x-"])
def test_invalid_names_are_refused(prime_cli, plugin_manager, tmp_path, name):
    result = prime_cli("plugin", "new", name, "--dir", str(tmp_path))
    assert result.exit_code != 0 and "invalid" in result.output


def test_existing_folder_is_not_overwritten(prime_cli, plugin_manager, tmp_path):
    (tmp_path / "prime-plugin-taken").mkdir()
    result = prime_cli("plugin", "new", "taken", "--dir", str(tmp_path))
    assert result.exit_code == 1 and "already exists" in result.output
