"""The GPU's clock and power while steps are measured (``--bench``), from ``nvidia-smi``.

A step's speed depends on the clock the GPU holds, and under sustained load an H100/H200 runs
into its power limit (700 W) and lowers its SM clock: the 2.9B MoE step ran its 40 measured
steps at 1,655 MHz on average (1,410 at the lowest; 1,980 at most), capped by power in every
sample (stop 57). Two machines' MFU can differ as their clocks do, so a benchmark row says
what the clock was.

``ClockSampler.for_device(device).start()`` runs ``nvidia-smi --query-gpu=... -lms 100`` for that GPU (by
UUID, whatever ``CUDA_VISIBLE_DEVICES`` says) until ``stop()``, which returns the summary, or
``None`` where there is no NVIDIA GPU or no ``nvidia-smi`` (CPUs, other vendors).
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import tempfile

QUERY = "clocks.sm,clocks.max.sm,power.draw,power.limit,clocks_event_reasons.active"
POWER = 0x4 | 0x80  # software power cap, hardware power brake
THERMAL = 0x8 | 0x20 | 0x40  # hardware slowdown, software and hardware thermal slowdown


class ClockSampler:
    def __init__(self, gpu: str | None, interval_ms: int = 100) -> None:
        """``gpu``: ``nvidia-smi -i``'s id (``None``: sample nothing)."""
        self.gpu = gpu
        self.interval_ms = interval_ms
        self._process: subprocess.Popen | None = None
        self._log = None  # an unlinked temporary file: nothing is left behind, whatever ends the run

    @classmethod
    def for_device(cls, device) -> ClockSampler:
        return cls(_gpu_id(device))

    def start(self) -> ClockSampler:
        gpu, smi = self.gpu, shutil.which("nvidia-smi")
        if gpu is None or smi is None or self._process is not None:
            return self
        self._log = tempfile.TemporaryFile()
        from prime_core.launch.lifeline import parent_death_signal

        # nvidia-smi -lms never ends by itself: tied to this process, so that a run that crashes
        # before ``stop`` leaves no sampler behind.
        self._process = subprocess.Popen([smi, "-i", gpu, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                                          f"-lms={self.interval_ms}"], stdout=self._log, stderr=subprocess.DEVNULL,
                                         preexec_fn=parent_death_signal())
        return self

    def stop(self) -> dict | None:
        """The summary of what was sampled since ``start`` (``None``: nothing was)."""
        if self._process is None:
            return None
        self._process.terminate()
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process = None
        self._log.seek(0)
        text = self._log.read().decode(errors="replace")
        self._log.close()
        return summarize(text)


def summarize(text: str) -> dict | None:
    """``nvidia-smi``'s CSV lines (``QUERY``, no header, no units) -> the clock and power summary;
    lines it could not read (a partial last line, ``[N/A]``) are skipped."""
    samples = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 5:
            continue
        try:
            clock, max_clock, power, limit = (float(f) for f in fields[:4])
            reasons = int(fields[4], 16)
        except ValueError:
            continue
        samples.append((clock, max_clock, power, limit, reasons))
    if not samples:
        return None
    clocks = [s[0] for s in samples]
    return {
        "gpu_clock_mhz_mean": statistics.mean(clocks), "gpu_clock_mhz_min": min(clocks),
        "gpu_clock_mhz_max": max(s[1] for s in samples),
        "gpu_power_w_max": max(s[2] for s in samples), "gpu_power_limit_w": max(s[3] for s in samples),
        "gpu_power_capped_share": sum(bool(s[4] & POWER) for s in samples) / len(samples),
        "gpu_thermal_share": sum(bool(s[4] & THERMAL) for s in samples) / len(samples),
        "gpu_clock_samples": len(samples),
    }


def over_ranks(summary: dict | None, world) -> dict | None:
    """Every rank's summary in one: the clocks' mean over the ranks that sampled, the lowest
    clock, the largest power and shares. Collective: every rank calls it."""
    from prime_core import distributed

    s = summary or {}
    present = float(bool(summary))
    total, ranks = distributed.all_reduce([s.get("gpu_clock_mhz_mean", 0.0) * present, present], world)
    if not ranks:
        return None
    keys = ("gpu_clock_mhz_max", "gpu_power_w_max", "gpu_power_limit_w", "gpu_power_capped_share",
            "gpu_thermal_share", "gpu_clock_samples")
    # The lowest clock as the largest of its negatives; a rank with no samples offers -1e9.
    worst = distributed.all_reduce([-s["gpu_clock_mhz_min"] if summary else -1e9, *(s.get(k, 0.0) for k in keys)],
                                   world, "max")
    return {"gpu_clock_mhz_mean": total / ranks, "gpu_clock_mhz_min": -worst[0],
            **dict(zip(keys, worst[1:], strict=True))}


def describe(summary: dict) -> str:
    """One line for the bench's table."""
    line = (f"{summary['gpu_clock_mhz_mean']:,.0f} MHz mean, {summary['gpu_clock_mhz_min']:,.0f} lowest, of "
            f"{summary['gpu_clock_mhz_max']:,.0f}; at the power limit ({summary['gpu_power_limit_w']:.0f} W) in "
            f"{100 * summary['gpu_power_capped_share']:.0f}% of samples")
    if summary["gpu_thermal_share"]:
        line += f", thermal slowdown in {100 * summary['gpu_thermal_share']:.0f}%"
    return line


def _gpu_id(device) -> str | None:
    """``nvidia-smi -i``'s id of a CUDA device: its UUID (``GPU-...``); ``None`` off CUDA."""
    if getattr(device, "type", device) != "cuda":
        return None
    import torch

    index = device.index if getattr(device, "index", None) is not None else torch.cuda.current_device()
    uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "")
    if not uuid:
        return None
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
