"""The local launcher: planning from a resolved config, and supervising real processes."""

import json
import sys
import time
from pathlib import Path

import pytest

import prime_plugin_local.plugin as plugin
from prime_core import PLUGIN_API_VERSION
from prime_core.launch.plan import LaunchPlan, RoleProcess
from prime_core.plugins import PluginManager

pytest_plugins = ["prime_core.testing"]


def test_declares_the_plugin_api():
    assert plugin.PRIME_PLUGIN_API == PLUGIN_API_VERSION


def test_registered_through_its_entry_point():
    manager = PluginManager(autoload=True, disabled=()).load()
    assert manager.records["local"].status == "active"
    assert "local" in manager.registry("launchers")


def test_dry_run_plans_three_roles_with_runnable_configs(register_plugin, prime_cli, tmp_path):
    register_plugin(plugin, name="local")
    out = tmp_path / "run"
    result = prime_cli("run", "--output-dir", str(out), "--dry-run")
    assert result.exit_code == 0, result.output
    plan = json.loads((out / "configs" / "plan.json").read_text())
    assert [p["role"] for p in plan["processes"]] == ["inference", "orchestrator", "trainer"]
    assert plan["commands"][2] == f"prime trainer {out / 'configs' / 'trainer.json'}"
    assert [p["service"] for p in plan["processes"]] == [True, False, False]
    assert not any((out / "logs").glob("*")), "a dry run starts nothing"


def test_multi_node_deployment_is_refused(register_plugin, prime_cli, tmp_path):
    register_plugin(plugin, name="local")
    result = prime_cli("run", "--output-dir", str(tmp_path), "--deployment.type", "multi_node", "--dry-run")
    assert result.exit_code == 2
    assert "local launcher runs on this machine only" in result.output


def _proc(tmp_path: Path, role: str, code: str, service: bool = False) -> RoleProcess:
    return RoleProcess(role=role, command=[sys.executable, "-c", code], config=tmp_path / f"{role}.json",
                       log=tmp_path / "logs" / f"{role}.log", service=service)


def test_failing_role_stops_the_others_and_is_named(tmp_path):
    sleeper = "import time; print('serving', flush=True); time.sleep(60)"
    crasher = "import sys; print('boom: out of disk', flush=True); sys.exit(7)"
    plan = LaunchPlan(launcher="local", output_dir=tmp_path, processes=[
        _proc(tmp_path, "inference", sleeper, service=True),
        _proc(tmp_path, "orchestrator", sleeper),
        _proc(tmp_path, "trainer", "import time; time.sleep(0.5); " + crasher),
    ])
    start = time.monotonic()
    code = plugin.launch(plan)
    assert code == 7
    assert time.monotonic() - start < 30, "the sleeping roles were stopped, not waited for"
    assert "boom: out of disk" in (tmp_path / "logs" / "trainer.log").read_text()


def test_success_stops_the_service(tmp_path):
    plan = LaunchPlan(launcher="local", output_dir=tmp_path, processes=[
        _proc(tmp_path, "inference", "import time; time.sleep(60)", service=True),
        _proc(tmp_path, "trainer", "print('done')"),
    ])
    assert plugin.launch(plan) == 0


def test_service_that_exits_early_is_a_failure(tmp_path):
    plan = LaunchPlan(launcher="local", output_dir=tmp_path, processes=[
        _proc(tmp_path, "inference", "print('port in use')", service=True),
        _proc(tmp_path, "trainer", "import time; time.sleep(60)"),
    ])
    assert plugin.launch(plan) != 0


def test_real_run_refuses_a_config_that_cannot_run_here(register_plugin, prime_cli, tmp_path):
    """With only the core and this launcher there are no environments: refuse before starting."""
    register_plugin(plugin, name="local")
    result = prime_cli("run", "--output-dir", str(tmp_path), "--inference", "None",
                       "--orchestrator.client.base-url", "http://127.0.0.1:9/v1")
    assert result.exit_code == 2
    assert "this run cannot start" in result.output
    assert not (tmp_path / "logs").exists()


def test_ctrl_c_stops_every_role(tmp_path):
    import os
    import signal
    import subprocess

    script = f"""
import sys
from pathlib import Path
import prime_plugin_local.plugin as plugin
from prime_core.launch.plan import LaunchPlan, RoleProcess
out = Path({str(tmp_path)!r})
code = "import os, time; open(os.environ['PIDFILE'], 'w').write(str(os.getpid())); time.sleep(120)"
plan = LaunchPlan(launcher="local", output_dir=out, processes=[
    RoleProcess(role=r, command=[sys.executable, "-c", code], config=out / f"{{r}}.json",
                log=out / "logs" / f"{{r}}.log", env={{"PIDFILE": str(out / f"{{r}}.pid")}}, service=r == "inference")
    for r in ("inference", "orchestrator", "trainer")])
sys.exit(plugin.launch(plan))
"""
    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    pids = [tmp_path / f"{r}.pid" for r in ("inference", "orchestrator", "trainer")]
    deadline = time.monotonic() + 60
    while not all(p.exists() and p.read_text() for p in pids):
        assert time.monotonic() < deadline and launcher.poll() is None, "roles did not start"
        time.sleep(0.1)
    launcher.send_signal(signal.SIGINT)
    output, _ = launcher.communicate(timeout=60)
    assert launcher.returncode == 130, output
    assert "interrupted: stopped every role" in output
    for pid_file in pids:
        pid = int(pid_file.read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
