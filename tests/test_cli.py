"""The `prime` command line: commands, exit codes, plugin commands, and start-up cost."""

import json
import os
import subprocess
import sys
import time

import typer

from prime_core import hookimpl
from prime_core.specs import CliCommand
from prime_core.testing import config_only_model


def test_help_lists_every_command(prime_cli, plugin_manager):
    result = prime_cli("--help")
    assert result.exit_code == 0
    for command in ("run", "config", "plugins", "plugin", "trainer", "orchestrator", "inference", "sft"):
        assert command in result.output


def test_version(prime_cli, plugin_manager):
    result = prime_cli("--version")
    assert result.exit_code == 0 and result.output.startswith("prime-core ")


def test_roles_refuse_a_model_that_is_not_here(prime_cli, plugin_manager, tmp_path):
    result = prime_cli("trainer", "--model.name", str(tmp_path / "missing"))
    assert result.exit_code == 2 and "model folder not found" in result.output


def test_role_commands_validate_their_config_first(prime_cli, plugin_manager, tmp_path):
    result = prime_cli("trainer", "--optim.lr", "fast")
    assert result.exit_code == 2 and "optim.lr" in result.output


def test_a_config_command_s_help_says_how_its_arguments_read_and_where_the_keys_are(prime_cli, plugin_manager):
    for command, root in (("run", "rl"), ("sft", "sft"), ("trainer", "trainer"), ("plan", "rl"), ("eval", "rl")):
        out = " ".join(prime_cli(command, "--help", env={"COLUMNS": "200"}).output.split())
        assert f"Usage: prime {command} [CONFIG]... [--KEY VALUE]..." in out, out
        assert f"`prime config keys --root {root} [PREFIX]`" in out and "TOML or YAML files" in out, out
    assert "--dry-run writes the resolved configs" in " ".join(prime_cli("run", "--help").output.split())


def test_config_keys_lists_each_key_with_its_default_and_what_it_does(prime_cli, plugin_manager):
    out = prime_cli("config", "keys", "trainer.optim").output.splitlines()
    assert "trainer.optim.lr = 1e-06" in out and "trainer.optim.betas = [0.9, 0.999]" in out, out
    assert out[out.index("trainer.optim.max_norm = 1.0") + 1] == "    Gradient-norm clipping; off when unset.", out
    assert all(line.startswith(("trainer.optim.", "    ")) for line in out), out
    sft = prime_cli("config", "keys", "--root", "sft", "data.name").output
    assert sft.startswith("data.name = null\n    `type = \"sft\"`: a Hugging Face dataset id"), sft
    missing = prime_cli("config", "keys", "trainer.optimm")
    assert missing.exit_code == 2 and "no key of the rl config starts with trainer.optimm" in missing.output


def test_config_show_formats(prime_cli, plugin_manager):
    as_json = json.loads(prime_cli("config", "show", "--format", "json", "--max-steps", "3").stdout)
    assert as_json["trainer"]["max_steps"] == 3
    assert "max_steps: 3" in prime_cli("config", "show", "--format", "yaml", "--max-steps", "3").stdout
    assert "max_steps = 3" in prime_cli("config", "show", "--max-steps", "3").stdout
    assert prime_cli("config", "show", "--format", "xml").exit_code == 2
    assert prime_cli("config", "show", "--root", "nope").exit_code == 2


def test_config_validate_reports_missing_capabilities(prime_cli, plugin_manager):
    result = prime_cli("config", "validate", "--trainer.model.ep", "8")
    assert result.exit_code == 2
    assert "trainer.model.ep" in result.output and "unknown key (a key of prime-plugin-ep" in result.output
    assert "pip install prime-plugin-ep" in result.output
    result = prime_cli("config", "validate", "--orchestrator.env", '[{"id": "reverse_text"}]')
    assert result.exit_code == 2
    assert "orchestrator.env[0].id = 'reverse_text': no installed plugin provides an environment named" in result.output
    result = prime_cli("config", "validate", "--orchestrator.advantage.type", "ppo")
    assert "orchestrator.advantage.type = 'ppo': no installed plugin provides an algorithm named 'advantage:ppo'" \
        in result.output


def test_a_typo_in_an_installed_plugins_section_is_a_typo(prime_cli, installed_plugins):
    # A key under a section of a loaded plugin is not "that plugin's, install it": it is a typo.
    for key, meant in (("--wandb.projet", "project"), ("--trainer.model.ac.freqq", "freq")):
        result = prime_cli("config", "validate", key, "2")
        assert result.exit_code == 2
        assert f"unknown key (did you mean '{meant}'?)" in result.output and "pip install" not in result.output


def test_config_validate_passes_when_everything_is_provided(prime_cli, register_plugin):
    from prime_core.specs import Environment, InferenceBackend, Launcher

    class Everything:
        @hookimpl
        def prime_launchers(self):
            return [Launcher(name="here", plan=print, launch=print)]

        @hookimpl
        def prime_select_launcher(self, config):
            return "here"

        @hookimpl
        def prime_environments(self):
            return [Environment(name="count", load=print)]

        @hookimpl
        def prime_inference_backends(self):
            return [InferenceBackend(name="test", server=print, client=print)]


    register_plugin(Everything(), name="everything")
    # HF_HUB_OFFLINE=0: the roles may download the default model, which is not cached here
    result = prime_cli("config", "validate", "--orchestrator.env", '[{"id": "count"}]', env={"HF_HUB_OFFLINE": "0"})
    assert result.exit_code == 0, result.output
    assert "config is valid" in result.output


def test_plugin_validators_and_required_plugins(prime_cli, register_plugin):
    class Picky:
        @hookimpl
        def prime_validate_config(self, config, root):
            if config.max_steps == 13:
                yield "max_steps: 13 is unlucky; pick another"

    register_plugin(Picky(), name="picky")
    result = prime_cli("config", "validate", "--max-steps", "13", "--required-plugins", "deepep", "picky")
    assert "max_steps: 13 is unlucky" in result.output
    assert "required_plugins: plugin 'deepep' is not active (not installed)" in result.output
    assert "plugin 'picky' is not active" not in result.output


def test_plugin_cli_commands_are_added_and_clashes_reported(prime_cli, register_plugin):
    tools = typer.Typer()

    @tools.command()
    def ping() -> None:
        typer.echo("pong")

    def single() -> None:
        typer.echo("single command")

    class Commands:
        @hookimpl
        def prime_cli_commands(self):
            return [CliCommand(name="tools", app=tools), CliCommand(name="solo", app=single),
                    CliCommand(name="run", app=single)]

    register_plugin(Commands(), name="commands")
    assert prime_cli("tools", "ping").output.strip() == "pong"
    assert prime_cli("solo").output.strip() == "single command"
    listed = json.loads(prime_cli("plugins", "list", "--json").stdout)
    assert any("'run' clashes with a built-in command" in c for c in listed["cli_conflicts"])


def test_dry_run_without_a_launcher_still_writes_configs(prime_cli, plugin_manager, tmp_path):
    result = prime_cli("run", "--output-dir", str(tmp_path), "--dry-run")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "configs" / "trainer.json").is_file()
    assert "a real run would stop here" in result.output


def test_run_refuses_before_writing_anything_when_not_runnable(prime_cli, plugin_manager, tmp_path):
    result = prime_cli("run", "--output-dir", str(tmp_path / "out"))
    assert result.exit_code == 2
    assert not (tmp_path / "out").exists()


def test_help_is_fast_and_imports_nothing_heavy():
    code = (
        "import sys, time; t = time.perf_counter();"
        "from prime_core.cli.app import build_app; build_app();"
        "print(time.perf_counter() - t);"
        "print(','.join(m for m in ('torch', 'transformers', 'vllm', 'pydantic', 'dynaconf') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[1] == "", f"building the CLI imported {out[1]}"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "prime_core", "--help"], capture_output=True, check=True,
                   env={**os.environ, "COLUMNS": "100"})
    elapsed = time.perf_counter() - start
    assert elapsed < 5.0, f"prime --help took {elapsed:.2f} s"


def test_eval_dry_run_says_what_it_would_do_and_starts_nothing(prime_cli, installed_plugins, tmp_path):
    model = config_only_model(tmp_path / "model", model_type="qwen3")
    out = tmp_path / "out"
    result = prime_cli("eval", "--model.name", str(model), "--orchestrator.env", '[{"id": "reverse_text"}]',
                       "--output-dir", str(out), "--dry-run")
    assert result.exit_code == 0, result.output
    assert f"dry run: would evaluate {model} through a vllm (auto: the available backend with the highest " \
           "priority) server it starts on reverse_text: 32 examples, 4 rollouts each" in result.output
    assert not (out / "logs").exists() and not (out / "eval").exists()


def test_a_role_refuses_dry_run_with_the_command_that_does_it(prime_cli, plugin_manager):
    result = prime_cli("orchestrator", "--dry-run")
    assert result.exit_code == 2 and "prime orchestrator has no --dry-run" in result.output
    assert "prime run CONFIG --dry-run` writes every role's config" in result.output
