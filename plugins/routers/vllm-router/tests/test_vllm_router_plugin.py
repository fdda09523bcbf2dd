"""prime-plugin-vllm-router without a server: the ``[inference.router]`` table, the plan the
launcher writes (the router between the replicas and the orchestrator, admin calls straight
to each engine), vllm-router's command line, and what is refused before anything starts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import prime_plugin_vllm_router.plugin as plugin
from prime_core import PLUGIN_API_VERSION
from prime_core.plugins import PluginManager
from prime_core.testing import free_ports

pytest_plugins = ["prime_core.testing"]


def test_declares_the_plugin_api_and_registers_through_its_entry_point():
    assert plugin.PRIME_PLUGIN_API == PLUGIN_API_VERSION
    manager = PluginManager(autoload=True, disabled=()).load()
    assert manager.records["vllm-router"].status == "active"


@pytest.fixture
def dry_run(prime_cli, tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "no-nvidia-smi"))

    def run(*args: str, root: str = "run"):
        out = tmp_path / "out"
        result = prime_cli(root, "--output-dir", str(out), "--dry-run", *args)
        plan = out / "configs" / "plan.json"
        return result, (json.loads(plan.read_text()) if plan.exists() else None), out

    return run


def test_the_router_runs_between_the_replicas_and_the_orchestrator(dry_run):
    result, plan, out = dry_run("--inference.parallel.dp", "2", "--inference.server.port", "8100",
                                "--inference.router.policy", "cache_aware", "--env-vars", '{"X": "1"}')
    assert result.exit_code == 0, result.output
    roles = [p["role"] for p in plan["processes"]]
    assert roles == ["inference[0]", "inference[1]", "vllm-router", "orchestrator", "trainer"]
    router = plan["processes"][2]
    assert router["service"] and not router["may_fail"] and router["env"] == {"X": "1"}
    assert plan["commands"][2] == f"X=1 prime vllm-router {out / 'configs' / 'inference.json'}"
    assert router["log"] == str(out / "logs" / "vllm-router.log")
    rows = {row["role"]: row for row in plan["placement"]}
    assert rows["vllm-router"]["port"] == 8102 and rows["orchestrator"]["port"] == "→ http://127.0.0.1:8102/v1"
    client = json.loads((out / "configs" / "orchestrator.json").read_text())["client"]
    assert client["base_url"] == ["http://127.0.0.1:8102/v1"], "requests go through the router"
    assert client["admin_base_url"] == ["http://127.0.0.1:8100/v1", "http://127.0.0.1:8101/v1"], "weights do not"


def test_vllm_routers_command_line(dry_run):
    from prime_core.cli.common import load_config
    from prime_plugin_vllm_router.process import command

    _, _, out = dry_run("--inference.parallel.dp", "2", "--inference.server.port", "8100",
                        "--inference.router.port", "9000", "--inference.router.args", '{"retry_max_retries": 2}')
    inference = load_config("inference", [str(out / "configs" / "inference.json")])
    argv = command(inference)
    assert argv[:3] == [sys.executable, "-m", "vllm_router.launch_router"]
    flags = " ".join(argv[3:])
    for expected in ("--host 127.0.0.1 --port 9000", "--worker-urls http://127.0.0.1:8100 http://127.0.0.1:8101",
                     "--policy consistent_hash", "--prometheus-host 127.0.0.1 --prometheus-port 9001",
                     "--worker-startup-timeout-secs 600", "--health-check-interval-secs 2",
                     "--log-level warning", "--retry-max-retries 2"):
        assert expected in flags, flags
    # The vllm-router flags it was built against still exist in the installed version.
    from vllm_router.launch_router import parse_router_args

    parsed = parse_router_args(argv[3:])
    assert parsed.worker_urls == ["http://127.0.0.1:8100", "http://127.0.0.1:8101"] and parsed.port == 9000


def test_a_base_url_set_by_hand_is_kept(dry_run):
    _, _, out = dry_run("--inference.parallel.dp", "2", "--inference.router.policy", "round_robin",
                        "--orchestrator.client.base-url", "http://gateway:9000/v1")
    client = json.loads((out / "configs" / "orchestrator.json").read_text())["client"]
    assert client["base_url"] == ["http://gateway:9000/v1"] and client["admin_base_url"] is None


def test_prime_inference_alone_starts_the_router_too(dry_run):
    result, plan, out = dry_run("--router.policy", "power_of_two", "--server.port", "8100", root="inference")
    assert result.exit_code == 0, result.output
    assert [p["role"] for p in plan["processes"]] == ["inference", "vllm-router"], "not inline: two processes"
    assert plan["commands"][1] == f"prime vllm-router {out / 'configs' / 'inference.json'}"


@pytest.mark.parametrize(("args", "message"), [
    (("--inference.router.port", "8001"),
     "inference.router.port = 8001 is a replica's port (inference.server.port 8000 to 8001 for 2 replica(s))"),
    (("--inference.router.metrics-port", "8000"), "inference.router.metrics_port = 8000 is a replica's port"),
    (("--inference.router.policy", "fastest"), "inference.router.policy"),
    (("--inference.router.args", '{"api_key": "x"}'), "a secret would be written"),
])
def test_bad_router_tables_are_refused_before_anything_starts(prime_cli, tmp_path, args, message):
    result = prime_cli("run", "--output-dir", str(tmp_path / "o"), "--inference.parallel.dp", "2", *args)
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
    assert not (tmp_path / "o" / "logs").exists()


def test_an_api_key_is_refused_because_vllm_router_checks_none(prime_cli, tmp_path, monkeypatch):
    """vllm-router 0.1.17 answers every request on its port, /collective_rpc included, and
    forwards it with the servers' key: it would open what the key closes."""
    monkeypatch.setenv("VLLM_API_KEY", "secret")
    result = prime_cli("run", "--output-dir", str(tmp_path / "o"), "--inference.router.policy", "round_robin")
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "inference.router: vllm-router checks no API key on its own endpoints" in text
    assert "orchestrator.client.router = 'consistent_hash'" in text and "secret" not in text


def test_the_slurm_launcher_refuses_the_router(prime_cli, tmp_path):
    result = prime_cli("run", "--output-dir", str(tmp_path / "o"), "--dry-run",
                       "--slurm.job-name", "x", "--inference.router.policy", "round_robin")
    assert result.exit_code != 0
    assert "the slurm launcher does not start plugins' services yet: vllm-router" in " ".join(result.output.split())


def test_the_command_needs_a_router_table_and_engines_that_answer(prime_cli, tmp_path):
    import socket

    config = tmp_path / "inference.json"
    config.write_text(json.dumps({"server": {"port": 8100}}))
    result = prime_cli("vllm-router", str(config))
    assert result.exit_code != 0 and "has no router table: nothing to route" in result.output
    with socket.socket() as closed:  # a port nothing answers on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        config.write_text(json.dumps({"server": {"port": port}, "startup_timeout": 1, "router": {"port": port + 5}}))
        result = prime_cli("vllm-router", str(config))
    assert result.exit_code != 0, result.output
    assert (f"the inference engine at http://127.0.0.1:{port} did not answer /health within 1 s "
            "(inference.startup_timeout)") in " ".join(result.output.split())


def test_readme_names_every_policy():
    from prime_plugin_vllm_router.config import POLICIES

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert all(f"`{policy}`" in readme for policy in POLICIES)


LAUNCHER = """
import sys
from pathlib import Path
from prime_core.launch.plan import LaunchPlan
from prime_core.launch.supervise import supervise
from prime_core.cli.common import load_config
from prime_plugin_vllm_router.process import service

config = Path(sys.argv[1])
plan = LaunchPlan(launcher="test", output_dir=config.parent, processes=[
    service(load_config("inference", [str(config)]), "inference", {"inference": config})])
print(supervise(plan).code, flush=True)
"""


def test_the_real_router_dies_with_its_launcher_and_frees_its_ports(tmp_path):
    """The launcher is killed with SIGKILL: vllm-router (exec'd by `prime vllm-router`, tied to
    the launcher) goes too. A stand-in answers the engine's /health only: no request is sent."""
    import http.server
    import os
    import signal
    import socket
    import subprocess
    import threading
    import time

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the standard library's name
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    engine = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    port = free_ports(2)  # the router and its metrics (a taken metrics port stops vllm-router)
    config = tmp_path / "inference.json"
    config.write_text(json.dumps({"output_dir": str(tmp_path), "server": {"port": engine.server_port},
                                  "router": {"port": port, "metrics_port": port + 1}}))
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(config)], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert launcher.poll() is None and time.monotonic() < deadline, "\n".join(
                log.read_text()[-2000:] for log in (tmp_path / "logs").glob("*.log"))
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        log = (tmp_path / "logs" / "vllm-router.log").read_text()
        assert "waiting for 1 engine(s) to answer /health" in log and "--policy consistent_hash" in log
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                time.sleep(0.2)
            except OSError:
                break
        else:
            pytest.fail("vllm-router outlived its launcher")
    finally:
        if launcher.poll() is None:
            launcher.kill()
        engine.shutdown()
