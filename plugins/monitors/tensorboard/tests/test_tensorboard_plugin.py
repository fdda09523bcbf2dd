"""prime-plugin-tensorboard, for real: event files written by the roles' ``MetricsLogger`` (and by
``prime sft``) read back with TensorBoard's own ``EventAccumulator``, one TensorBoard run per
role under ``output_dir/tensorboard``; a resumed role replaces the steps it redoes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prime_core import PLUGIN_API_VERSION
from prime_plugin_tensorboard import plugin

pytest_plugins = ["prime_core.testing"]


def accumulator(logdir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir))
    events.Reload()
    return events


def scalars(logdir: Path, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in accumulator(logdir).Scalars(tag)]


def text(logdir: Path, tag: str) -> list[tuple[int, str]]:
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in accumulator(logdir).Tensors(tag)]


def role_logger(installed_plugins, out: Path, role: str):
    from prime_core.cli.common import load_config
    from prime_core.metrics import MetricsLogger

    config = load_config(role, [str(out / "configs" / f"{role}.json")], installed_plugins)
    return MetricsLogger(config, role=role, output_dir=config.output_dir)


def test_declares_the_plugin_api():
    assert plugin.PRIME_PLUGIN_API == PLUGIN_API_VERSION


def test_importing_the_plugin_imports_neither_tensorboard_nor_torch():
    code = ("import sys, prime_plugin_tensorboard.plugin as p; p.prime_monitors(); p.prime_config_sections(); "
            "heavy = [m for m in ('tensorboard', 'torch') if m in sys.modules]; assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_available_names_the_install_command(monkeypatch):
    from prime_plugin_tensorboard import monitor

    assert monitor.missing() is None
    monkeypatch.setattr(monitor.importlib.util, "find_spec", lambda name: None)
    assert "pip install prime-plugin-tensorboard" in monitor.missing()


def test_rl_roles_write_one_run_each_and_a_resume_replaces_redone_steps(installed_plugins, prime_cli, tmp_path,
                                                                          capsys):
    out = tmp_path / "out"
    result = prime_cli("run", "--model.name", "m", "--max-steps", "5", "--tensorboard.flush-secs", "1",
                       "--orchestrator.tensorboard.dir", "tb", "--trainer.tensorboard.dir", "tb",
                       "--output-dir", str(out), "--dry-run")
    assert result.exit_code == 0, result.output
    for role in ("trainer", "orchestrator"):
        section = json.loads((out / "configs" / f"{role}.json").read_text())["tensorboard"]
        assert section == {"dir": "tb", "flush_secs": 1}

    trainer, orchestrator = role_logger(installed_plugins, out, "trainer"), role_logger(installed_plugins, out,
                                                                                      "orchestrator")
    for step in range(1, 5):
        trainer.log(step, {"loss": 1.0 / step, "optim": {"grad_norm": 2.0}})
        orchestrator.log(step, {"reward": step / 10, "env_rewards": {"arithmetic": 0.5}, "policy": f"v{step - 1}"})
    trainer.close()
    orchestrator.close()
    assert f"view them with: tensorboard --logdir {out / 'tb'}" in capsys.readouterr().out

    runs = out / "tb"
    assert sorted(p.name for p in runs.iterdir()) == ["orchestrator", "trainer"]
    assert scalars(runs / "trainer", "loss") == [(s, pytest.approx(1.0 / s)) for s in range(1, 5)]
    assert scalars(runs / "trainer", "optim/grad_norm") == [(s, 2.0) for s in range(1, 5)]
    assert scalars(runs / "orchestrator", "reward") == [(s, pytest.approx(s / 10)) for s in range(1, 5)]
    assert scalars(runs / "orchestrator", "env_rewards/arithmetic") == [(s, 0.5) for s in range(1, 5)]
    assert text(runs / "orchestrator", "policy") == [(s, f"v{s - 1}") for s in range(1, 5)]
    assert "reward" not in accumulator(runs / "trainer").Tags()["scalars"]
    ((step, config),) = text(runs / "trainer", "config")
    assert step == 1 and '"max_steps": 5' in config

    # --resume: the trainer redoes steps 3 and 4, then goes on to 5.
    resumed = role_logger(installed_plugins, out, "trainer")
    for step in range(3, 6):
        resumed.log(step, {"loss": 10.0 * step, "optim": {"grad_norm": 2.0}})
    resumed.close()
    assert len(list((runs / "trainer").glob("events.out.tfevents.*"))) == 2
    assert scalars(runs / "trainer", "loss") == [(1, 1.0), (2, 0.5), (3, 30.0), (4, 40.0), (5, 50.0)]


@pytest.mark.slow  # a real `prime sft` process: ~30 s on 2 shared cores
def test_sft_writes_its_own_run(tmp_path):
    from prime_plugin_hf.tiny import build_tiny

    tiny = build_tiny(tmp_path / "tiny", hidden_size=64, num_layers=1)
    out = tmp_path / "sft"
    result = subprocess.run([sys.executable, "-m", "prime_core", "sft", "--model.name", str(tiny), "--data.type",
                             "fake", "--data.batch-size", "2", "--seq-len", "64", "--max-steps", "3",
                             "--output-dir", str(out), "--tensorboard"],
                            capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"tensorboard --logdir {out / 'tensorboard'}" in result.stdout
    expected = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [p.name for p in (out / "tensorboard").iterdir()] == ["sft"]
    assert scalars(out / "tensorboard" / "sft", "loss") == [(e["step"], pytest.approx(e["loss"])) for e in expected]
    assert len(expected) == 3
