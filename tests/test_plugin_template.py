"""`prime plugin new` writes a plugin that installs, is listed, and whose hooks the core calls."""

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


@pytest.mark.parametrize("name", ["Bad", "9lives", "a b", "x-"])
def test_invalid_names_are_refused(prime_cli, plugin_manager, tmp_path, name):
    result = prime_cli("plugin", "new", name, "--dir", str(tmp_path))
    assert result.exit_code != 0 and "invalid" in result.output


def test_existing_folder_is_not_overwritten(prime_cli, plugin_manager, tmp_path):
    (tmp_path / "prime-plugin-taken").mkdir()
    result = prime_cli("plugin", "new", "taken", "--dir", str(tmp_path))
    assert result.exit_code == 1 and "already exists" in result.output
