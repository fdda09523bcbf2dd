"""prime-plugin-slurm: the [slurm] table loads (seed configs included) and runs are refused honestly."""

from pathlib import Path

import prime_plugin_slurm.plugin as plugin
from prime_core import PLUGIN_API_VERSION

pytest_plugins = ["prime_core.testing"]

SEEDS = Path(__file__).resolve().parents[4] / "examples" / "seeds"


def test_declares_the_plugin_api():
    assert plugin.PRIME_PLUGIN_API == PLUGIN_API_VERSION


def test_overlay_loads(register_plugin, prime_cli):
    register_plugin(plugin, name="slurm")
    result = prime_cli("config", "show", "--format", "json", str(SEEDS / "slurm_overlay.toml"))
    assert result.exit_code == 0, result.output
    assert '"job_name": "my-rl-run"' in result.output


def test_flat_legacy_keys_move_to_slurm_and_deployment(register_plugin, prime_cli):
    register_plugin(plugin, name="slurm")
    result = prime_cli("config", "show", "--format", "json", str(SEEDS / "slurm_moe_hendrycks.toml"))
    assert result.exit_code == 0, result.output
    assert '"job_name": "hendrycks-math-moe"' in result.output
    assert '"type": "multi_node"' in result.output


def test_template_path_must_exist(register_plugin, prime_cli):
    register_plugin(plugin, name="slurm")
    result = prime_cli("config", "show", "--slurm.template-path", "/nonexistent/t.sh.j2")
    assert result.exit_code == 2
    assert "slurm.template_path" in result.output and "file not found" in result.output


def test_validate_refuses_to_pretend(register_plugin, prime_cli):
    register_plugin(plugin, name="slurm")
    result = prime_cli("config", "validate", "--slurm.job-name", "x")
    assert result.exit_code == 2
    assert "cannot submit jobs yet" in result.output


def test_unknown_without_the_plugin(plugin_manager, prime_cli):
    result = prime_cli("config", "show", str(SEEDS / "slurm_overlay.toml"))
    assert result.exit_code == 2
    assert "slurm" in result.output and "unknown key" in result.output
