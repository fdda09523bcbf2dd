"""``prime_core.gpu_clocks``: the clock and power summary of ``--bench`` rows, from a stand-in
``nvidia-smi`` (a script on PATH that checks its arguments and prints what the real one does)."""

import os
import stat
import subprocess
import sys
import time

import pytest
import torch

from prime_core import gpu_clocks
from prime_core.distributed import World
from prime_core.launch.lifeline import start_time

# What nvidia-smi printed during stop 57's MoE step (--format=csv,noheader,nounits), and its odd lines.
LINES = """1980, 1980, 118.25, 700.00, 0x0000000000000000
1725, 1980, 187.12, 700.00, 0x0000000000000004
1410, 1980, 710.71, 700.00, 0x0000000000000004
1515, 1980, 703.09, 700.00, 0x0000000000000024
[N/A], 1980, 700.00, 700.00, 0x0000000000000004
1605, 19"""


def test_the_summary_counts_the_clocks_and_why_they_were_lowered():
    summary = gpu_clocks.summarize(LINES)
    assert summary["gpu_clock_samples"] == 4  # the [N/A] line and the partial last one skipped
    assert summary["gpu_clock_mhz_mean"] == pytest.approx((1980 + 1725 + 1410 + 1515) / 4)
    assert summary["gpu_clock_mhz_min"] == 1410 and summary["gpu_clock_mhz_max"] == 1980
    assert summary["gpu_power_w_max"] == pytest.approx(710.71) and summary["gpu_power_limit_w"] == 700
    assert summary["gpu_power_capped_share"] == 0.75 and summary["gpu_thermal_share"] == 0.25
    line = gpu_clocks.describe(summary)
    assert "1,658 MHz mean, 1,410 lowest, of 1,980" in line and "power limit (700 W) in 75%" in line
    assert "thermal slowdown in 25%" in line
    assert gpu_clocks.summarize("") is None and gpu_clocks.summarize("No devices were found\n") is None
    # One process: the summary over the ranks is its own.
    world = World()
    assert gpu_clocks.over_ranks(summary, world) == pytest.approx(summary)
    assert gpu_clocks.over_ranks(None, world) is None


def test_the_sampler_runs_nvidia_smi_for_its_gpu_until_stopped(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    args = tmp_path / "args"
    smi.write_text(f"""#!/usr/bin/env bash
echo "$@" > {args}
while true; do echo "1700, 1980, 690.5, 700.00, 0x0000000000000004"; sleep 0.02; done
""")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    sampler = gpu_clocks.ClockSampler("GPU-1234").start()
    time.sleep(0.5)
    summary = sampler.stop()
    assert args.read_text().split() == ["-i", "GPU-1234", f"--query-gpu={gpu_clocks.QUERY}",
                                        "--format=csv,noheader,nounits", "-lms=100"]
    assert summary["gpu_clock_samples"] >= 3 and summary["gpu_clock_mhz_mean"] == 1700
    assert summary["gpu_power_capped_share"] == 1.0
    assert sampler.stop() is None  # stopped once
    # No GPU id (a CPU, another vendor) or no nvidia-smi: nothing runs, nothing is reported.
    assert gpu_clocks.ClockSampler(None).start().stop() is None
    assert gpu_clocks.ClockSampler.for_device(torch.device("cpu")).gpu is None
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert gpu_clocks.ClockSampler("GPU-1234").start().stop() is None


def test_a_sampler_never_stopped_ends_with_its_process(tmp_path):
    """A run that dies before ``stop`` (an exception, SIGKILL) leaves no nvidia-smi behind."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/usr/bin/env bash\necho $$ > {tmp_path / 'pid'}\nwhile true; do sleep 0.05; done\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    code = ("import os, signal, time\nfrom prime_core.gpu_clocks import ClockSampler\n"
            "ClockSampler('GPU-1').start()\ntime.sleep(0.5)\nos.kill(os.getpid(), signal.SIGKILL)\n")
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run([sys.executable, "-c", code], env=env, check=False, timeout=60)
    pid = int((tmp_path / "pid").read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _running(pid):
        time.sleep(0.1)
    assert not _running(pid), "nvidia-smi outlived the process that started it"


def _running(pid: int) -> bool:
    return start_time(pid) is not None  # None: gone, or a zombie
