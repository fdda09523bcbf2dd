"""The wandb monitor meets prime's monitor contract offline (the contract's sandbox has no
credentials); what it records is read back with wandb's own reader."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from prime_core.testing.contracts.monitor import MonitorContract


@pytest.fixture(autouse=True)
def own_wandb_service(monkeypatch):
    """Role processes start their own wandb service, as in a run; one an earlier test started
    in this process announces itself through WANDB_SERVICE."""
    monkeypatch.delenv("WANDB_SERVICE", raising=False)


class TestWandb(MonitorContract):
    name = "wandb"
    role_processes = True  # wandb keeps one run per id in a process; roles are processes in a run

    def logged(self, output_dir: Path):
        (run_dir,) = (output_dir / "wandb").glob("offline-run-*-trainer")
        result = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
                                capture_output=True, text=True, timeout=120, check=True)
        items = [json.loads(line)["history"]["item"] for line in result.stdout.splitlines()
                 if line.startswith("{") and json.loads(line)["type"] == "history"]
        return [(item["trainer/step"],
                 {k.removeprefix("trainer/"): v for k, v in item.items() if k.startswith("trainer/")})
                for item in items]
