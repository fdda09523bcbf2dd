"""prime-plugin-wandb, for real and offline (no account, no network, no mock of wandb):

- the ``[wandb]`` table reaches the trainer's and the orchestrator's resolved configs, a role's
  own table winning key by key, and the seeds with ``[wandb]`` tables load;
- the trainer and the orchestrator, started as two processes from the configs ``prime run
  --dry-run`` wrote, log into one W&B run id under ``output_dir`` (read back with wandb's own
  reader, ``wandb leet inspect --json``);
- ``prime sft`` logs into its own offline run;
- offline is chosen, and said, without an API key or a reachable server.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from prime_core import PLUGIN_API_VERSION
from prime_plugin_wandb import monitor, plugin

pytest_plugins = ["prime_core.testing"]

SEEDS = Path(__file__).resolve().parents[4] / "examples" / "seeds"
ROLE_SCRIPT = """
import asyncio
import sys
from prime_core.cli.common import load_config
from prime_core.metrics import MetricsLogger

role, path = sys.argv[1], sys.argv[2]
config = load_config(role, [path])          # the role's resolved config, as `prime <role> FILE` loads it

def run():
    metrics = MetricsLogger(config, role=role, output_dir=config.output_dir)   # as the role builds it
    for step in range(1, 4):
        metrics.log(step, {"loss": 1.0 / step, "env_rewards": {"arithmetic": step / 10}})
    metrics.close()

async def in_event_loop():  # the orchestrator builds and uses its MetricsLogger inside its asyncio loop
    run()

asyncio.run(in_event_loop()) if role == "orchestrator" else run()
"""


@pytest.fixture
def no_account(tmp_path, monkeypatch) -> dict[str, str]:
    """An environment with no W&B credentials and wandb's own files kept in ``tmp_path``."""
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "NETRC"}
    env.update(HOME=str(home), WANDB_CONFIG_DIR=str(home / ".config" / "wandb"), WANDB_CACHE_DIR=str(home / "cache"),
               WANDB_DATA_DIR=str(home / "data"), HF_HUB_OFFLINE="1")
    for key in [k for k in os.environ if k.startswith("WANDB_") or k == "NETRC"]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("HOME", str(home))
    return env


def prime(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prime_core", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300, check=False)


def records(run_dir: Path, env: dict[str, str]) -> list[dict]:
    """The records of an offline run's transaction log, through wandb's own reader."""
    result = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
                            capture_output=True, text=True, env=env, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def history(run_dir: Path, env: dict[str, str]) -> list[dict]:
    return [r["history"]["item"] for r in records(run_dir, env) if r["type"] == "history"]


def run_record(run_dir: Path, env: dict[str, str]) -> dict:
    return next(r["run"] for r in records(run_dir, env) if r["type"] == "run")


def test_declares_the_plugin_api():
    assert plugin.PRIME_PLUGIN_API == PLUGIN_API_VERSION


def test_importing_the_plugin_imports_neither_wandb_nor_torch():
    code = ("import sys, prime_plugin_wandb.plugin as p; p.prime_monitors(); p.prime_config_sections(); "
            "heavy = [m for m in ('wandb', 'torch') if m in sys.modules]; assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_available_names_the_install_command(monkeypatch):
    assert monitor.missing() is None
    monkeypatch.setattr(monitor.importlib.util, "find_spec", lambda name: None)
    assert "pip install prime-plugin-wandb" in monitor.missing()


# ---------------------------------------------------------------------------- the table


def test_top_level_table_reaches_both_roles_and_role_tables_win(installed_plugins, prime_cli, tmp_path):
    config = tmp_path / "rl.toml"
    config.write_text('max_steps = 3\n[model]\nname = "m"\n'
                      '[wandb]\nproject = "top"\nname = "shared"\ntags = ["a"]\n'
                      '[trainer.wandb]\nname = "trainer-only"\n[orchestrator.wandb]\ngroup = "g"\n')
    out = tmp_path / "out"
    result = prime_cli("run", str(config), "--output-dir", str(out), "--dry-run")
    assert result.exit_code == 0, result.output
    trainer, orchestrator, inference = (json.loads((out / "configs" / f"{r}.json").read_text())
                                        for r in ("trainer", "orchestrator", "inference"))
    assert trainer["wandb"]["project"] == orchestrator["wandb"]["project"] == "top"
    assert trainer["wandb"]["tags"] == orchestrator["wandb"]["tags"] == ["a"]
    assert (trainer["wandb"]["name"], orchestrator["wandb"]["name"]) == ("trainer-only", "shared")
    assert (trainer["wandb"]["group"], orchestrator["wandb"]["group"]) == (None, "g")
    assert "wandb" not in inference


def test_roles_sharing_a_run_must_agree_on_its_project(installed_plugins, prime_cli, tmp_path):
    result = prime_cli("config", "validate", "--wandb.project", "p", "--trainer.wandb.project", "q")
    assert result.exit_code == 2
    assert "trainer.wandb.project / orchestrator.wandb.project" in result.output
    ok = prime_cli("config", "validate", "--wandb.shared", "false", "--trainer.wandb.project", "q")
    assert "wandb.project" not in ok.output


@pytest.mark.parametrize("seed", ["slurm_dense_hendrycks.toml", "slurm_moe_hendrycks.toml"])
def test_the_slurm_seeds_load(installed_plugins, prime_cli, seed):
    result = prime_cli("config", "show", "--format", "json", str(SEEDS / seed))
    assert result.exit_code == 0, result.output
    config = json.loads(result.stdout)
    if "[wandb]" in (SEEDS / seed).read_text():
        for section in (config["wandb"], config["trainer"]["wandb"], config["orchestrator"]["wandb"]):
            assert (section["project"], section["name"]) == ("hendrycks-math", "hendrycks-math")


def test_prime_rl_log_extras_is_accepted(installed_plugins, prime_cli):
    result = prime_cli("config", "show", "--format", "json", "--orchestrator.wandb.log-extras.interval", "5")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["orchestrator"]["wandb"]["log_extras"]["interval"] == 5


# ---------------------------------------------------------------------------- offline or not


def test_offline_without_credentials_and_with_them_only_if_reachable(no_account, monkeypatch, tmp_path):
    from prime_plugin_wandb.config import WandbConfig

    reason = monitor.missing_credentials()
    assert "WANDB_API_KEY is unset" in reason and ".netrc has no entry for api.wandb.ai" in reason
    assert monitor.choose_mode(WandbConfig()) == ("offline", reason)
    netrc = tmp_path / "home" / ".netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "0" * 40 + "\n")
    netrc.chmod(0o600)
    assert monitor.missing_credentials() is None
    # A server that does not answer: offline, after the short probe only.
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    assert monitor.missing_credentials() is not None  # the .netrc entry is for api.wandb.ai
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    assert monitor.missing_credentials() is None
    mode, why = monitor.choose_mode(WandbConfig())
    assert mode == "offline" and f"cannot reach 127.0.0.1:{port}" in why
    assert monitor.choose_mode(WandbConfig(offline=True)) == ("offline", "wandb.offline = true")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert monitor.choose_mode(WandbConfig())[0] == "disabled"


def test_a_listening_server_is_reachable():
    with socket.create_server(("127.0.0.1", 0)) as server:
        assert monitor.unreachable(f"http://127.0.0.1:{server.getsockname()[1]}") is None


def test_two_roles_starting_at_once_agree_on_the_run_id(tmp_path):
    code = "import sys; from prime_plugin_wandb.monitor import shared_run_id; print(shared_run_id(sys.argv[1]))"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
             for _ in range(4)]
    ids = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert len(ids) == 1 and ids == {(tmp_path / "logs" / "wandb-run-id").read_text().strip()}


# ---------------------------------------------------------------------------- real offline runs


def test_trainer_and_orchestrator_log_into_one_offline_run(installed_plugins, prime_cli, no_account, tmp_path):
    out = tmp_path / "out"
    result = prime_cli("run", "--model.name", "m", "--max-steps", "3", "--wandb.project", "prime-test",
                       "--output-dir", str(out), "--dry-run")
    assert result.exit_code == 0, result.output
    script = tmp_path / "role.py"
    script.write_text(ROLE_SCRIPT)
    procs = {role: subprocess.Popen([sys.executable, str(script), role, str(out / "configs" / f"{role}.json")],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=no_account,
                                    cwd=tmp_path)
             for role in ("trainer", "orchestrator")}
    logs = {role: proc.communicate(timeout=240)[0] for role, proc in procs.items()}
    for role, proc in procs.items():
        assert proc.returncode == 0, logs[role]

    run_id = (out / "logs" / "wandb-run-id").read_text().strip()
    # by role: the two roles may start in different seconds, and the folder names begin with the time
    folders = sorted((out / "wandb").glob(f"offline-run-*-{run_id}-*"), key=lambda f: f.name.rsplit("-", 1)[1])
    assert [f.name.rsplit("-", 1)[1] for f in folders] == ["orchestrator", "trainer"], folders
    for role, folder in zip(("orchestrator", "trainer"), folders, strict=True):
        log = logs[role]
        assert "OFFLINE mode, because of: no W&B API key" in log, log
        assert f"wandb sync {out / 'wandb'}/offline-run-*-{run_id}*" in log
        run = run_record(folder, no_account)
        assert (run["run_id"], run["project"], run["resume"]) == (run_id, "prime-test", True)
        rows = history(folder, no_account)
        assert [r[f"{role}/step"] for r in rows] == [1, 2, 3]
        assert [r[f"{role}/loss"] for r in rows] == [1.0, 0.5, pytest.approx(1 / 3)]
        assert [r[f"{role}/env_rewards/arithmetic"] for r in rows] == [0.1, 0.2, 0.3]
        other = "trainer" if role == "orchestrator" else "orchestrator"
        assert not any(key.startswith(f"{other}/") for r in rows for key in r)

    # `wandb sync` (as printed in the logs) uploads both roles' files into that one run.
    sync = subprocess.run(f"{sys.executable} -m wandb sync --dry-run {out / 'wandb'}/offline-run-*-{run_id}*",
                          shell=True, capture_output=True, text=True, env=no_account, timeout=120, check=False)
    assert sync.returncode == 0, sync.stderr
    assert "Would sync 2 run(s)" in sync.stdout + sync.stderr
    # metrics.jsonl has the same steps, untouched.
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 6


@pytest.fixture
def failing_server():
    """A server on the loopback that answers every request with HTTP 500 (stops with the test)."""
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.5)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(2)
                try:
                    conn.recv(65536)
                    conn.sendall(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n"
                                 b"Connection: close\r\n\r\n")
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join(5)
    server.close()


def test_a_server_that_fails_means_offline_not_a_failed_run(no_account, failing_server, tmp_path):
    script = tmp_path / "sft.py"
    script.write_text("from types import SimpleNamespace\n"
                      "from prime_plugin_wandb import monitor\n"
                      "monitor.INIT_TIMEOUT_S = 8.0  # the monitor's 30 s: a broken server fails the same way sooner\n"
                      "from prime_plugin_wandb.config import WandbConfig\n"
                      "from prime_plugin_wandb.monitor import WandbMonitor\n"
                      "sink = WandbMonitor(SimpleNamespace(wandb=WandbConfig()), output_dir='out', role='sft')\n"
                      "sink.log({'loss': 2.5}, 1)\n"
                      "sink.close()\n")
    env = {**no_account, "WANDB_API_KEY": "0" * 40, "WANDB_BASE_URL": failing_server}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path,
                            timeout=240, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "online init failed" in result.stdout
    assert "OFFLINE mode, because of: the online run could not start" in result.stdout
    run_id = (tmp_path / "out" / "logs" / "wandb-run-id").read_text().strip()
    (folder,) = (tmp_path / "out" / "wandb").glob(f"offline-run-*-{run_id}")
    assert [r["sft/loss"] for r in history(folder, no_account)] == [2.5]


@pytest.mark.slow  # a real `prime sft` process: ~30 s on 2 shared cores
def test_sft_logs_into_its_own_offline_run(no_account, tmp_path):
    from prime_plugin_hf.tiny import build_tiny

    tiny = build_tiny(tmp_path / "tiny", hidden_size=64, num_layers=1)
    out = tmp_path / "sft"
    result = prime("sft", "--model.name", str(tiny), "--data.type", "fake", "--data.batch-size", "2",
                   "--seq-len", "64", "--max-steps", "3", "--output-dir", str(out), "--wandb.name", "my-sft",
                   env=no_account, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    run_id = (out / "logs" / "wandb-run-id").read_text().strip()
    (folder,) = (out / "wandb").glob(f"offline-run-*-{run_id}")
    assert "OFFLINE mode" in result.stdout and f"wandb sync {out / 'wandb'}/offline-run-*-{run_id}*" in result.stdout
    run = run_record(folder, no_account)
    assert (run["run_id"], run["display_name"]) == (run_id, "my-sft")
    rows = history(folder, no_account)
    expected = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["sft/step"] for r in rows] == [e["step"] for e in expected] == [1, 2, 3]
    assert [r["sft/loss"] for r in rows] == [pytest.approx(e["loss"]) for e in expected]


def test_wandb_mode_disabled_writes_nothing(no_account, monkeypatch, tmp_path, capsys):
    from types import SimpleNamespace

    from prime_plugin_wandb.config import WandbConfig

    monkeypatch.setenv("WANDB_MODE", "disabled")
    sink = monitor.WandbMonitor(SimpleNamespace(wandb=WandbConfig()), output_dir=tmp_path, role="trainer")
    sink.log({"loss": 1.0}, 1)
    sink.close()
    assert "disabled (WANDB_MODE=disabled)" in capsys.readouterr().out
    assert not (tmp_path / "wandb").exists() and not (tmp_path / "logs").exists()
