"""The built-in ``jsonl`` monitor meets the monitor contract, and the suite fails on monitors
that break it."""

import json
import os
from pathlib import Path

import pytest

from prime_core.builtin import JsonlMonitor
from prime_core.metrics import read_jsonl
from prime_core.specs import Monitor
from prime_core.testing.contracts import ContractError
from prime_core.testing.contracts import monitor as contract
from prime_core.testing.contracts.monitor import MonitorContract


class TestJsonl(MonitorContract):
    name = "jsonl"
    plugin = "prime_core.builtin"

    def logged(self, output_dir):
        return [(r["step"], r) for r in read_jsonl(output_dir / "metrics.jsonl") if r["role"] == "trainer"]


def test_jsonl_lines_stay_whole_when_two_roles_log_at_once(tmp_path):
    contract.check_concurrent_roles(Monitor(name="jsonl", make=JsonlMonitor), tmp_path, steps=50)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert sorted((r["role"], r["step"]) for r in records) == sorted(
        (role, step) for role in ("trainer", "orchestrator") for step in range(1, 51))


def spec(cls):
    return Monitor(name="broken", make=cls)


class NoClose:
    def __init__(self, config, *, output_dir, role):
        pass

    def log(self, metrics, step):
        pass


class FloatsOnly(JsonlMonitor):
    def log(self, metrics, step):
        super().log({k: float(v) for k, v in metrics.items()}, step)


class Pops(JsonlMonitor):
    def log(self, metrics, step):
        metrics.pop("loss", None)  # "consumed": the next sink never sees it
        super().log(metrics, step)


class WritesToCwd(JsonlMonitor):
    def log(self, metrics, step):
        with open("metrics.csv", "a") as f:  # relative: lands in the working directory
            f.write(f"{step}\n")


class Exclusive(JsonlMonitor):
    """Claims output_dir for itself: the second role of the run cannot start."""

    def __init__(self, config, *, output_dir, role):
        super().__init__(config, output_dir=output_dir, role=role)
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        self.lock = os.open(Path(output_dir) / "monitor.lock", os.O_CREAT | os.O_EXCL)

    def close(self):
        os.close(self.lock)


class DropsRewards(JsonlMonitor):
    def log(self, metrics, step):
        super().log({k: v for k, v in metrics.items() if not k.startswith("reward")}, step)


@pytest.mark.parametrize(("cls", "message"), [
    (NoClose, "has no close\\(\\) method"),
    (FloatsOnly, "log\\(metrics, 2\\) raised TypeError"),
    (Pops, "log\\(\\) changed the metrics dict"),
    (WritesToCwd, "wrote outside output_dir: .*metrics.csv"),
])
def test_broken_monitors_fail(cls, message, tmp_path, monkeypatch):
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    with pytest.raises(ContractError, match=message):
        contract.check_roles(spec(cls), tmp_path / "run", tmp_path)


def test_a_monitor_two_roles_cannot_share_fails(tmp_path):
    with pytest.raises(ContractError, match="two roles logging at once failed: FileExistsError"):
        contract.check_concurrent_roles(spec(Exclusive), tmp_path)


def test_a_monitor_that_loses_values_fails(tmp_path):
    sink = DropsRewards(None, output_dir=tmp_path, role="trainer")
    contract.log_steps(spec(DropsRewards), sink)
    records = [(r["step"], r) for r in read_jsonl(tmp_path / "metrics.jsonl")]
    with pytest.raises(ContractError, match="step 2 reward = 0.25 was recorded as '\\(missing\\)'"):
        contract.check_recorded(spec(DropsRewards), records)
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[2])["loss"] == "nan"


def test_a_plugin_monitor_is_switched_on_by_its_own_config_section(register_plugin, tmp_path):
    from prime_core import PLUGIN_API_VERSION, hookimpl
    from prime_core.cli.common import load_config
    from prime_core.config.base import Section
    from prime_core.metrics import MetricsLogger
    from prime_core.specs import ConfigSection

    class Sink(JsonlMonitor):
        pass

    class ProbeConfig(Section):
        every: int = 1

    class Probe:
        PRIME_PLUGIN_API = PLUGIN_API_VERSION

        @hookimpl
        def prime_monitors(self):
            return [Monitor(name="probe", make=Sink)]

        @hookimpl
        def prime_config_sections(self):
            return [ConfigSection(name="trainer.probe", model=ProbeConfig)]

    register_plugin(Probe(), name="probe")
    on = load_config("trainer", ["--probe.every", "2"])
    off = load_config("trainer", [])
    kinds = [type(s) for s in MetricsLogger(on, role="trainer", output_dir=tmp_path).sinks]
    assert kinds == [JsonlMonitor, Sink]
    assert [type(s) for s in MetricsLogger(off, role="trainer", output_dir=tmp_path).sinks] == [JsonlMonitor]
