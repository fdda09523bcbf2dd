"""What ``prime report`` reads from ``metrics.jsonl`` and how it shows it.

Each record of ``metrics.jsonl`` carries its ``role`` (``trainer``, ``orchestrator``, ``eval``,
``sft``) and ``step``; nested metrics are flattened (``<env>/pass@1`` for an eval). A panel is
one quantity over the steps, each run drawn in its own colour (the second line of a panel, when
there is one, dashed).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from prime_core.errors import PrimeError
from prime_core.metrics import METRICS_FILE, read_jsonl


@dataclass(frozen=True)
class Line:
    role: str
    key: str
    """A metric name, or a regular expression over names (one line per matching name)."""
    label: str = ""


PANELS: tuple[tuple[str, tuple[Line, ...]], ...] = (
    ("reward", (Line("orchestrator", "reward", "sampled"),)),
    ("eval pass@k", (Line("eval", r"(.+)/pass@(\d+)"),)),
    ("loss", (Line("trainer", "loss", "rl"), Line("sft", "loss", "sft"))),
    ("entropy", (Line("trainer", "entropy"),)),
    ("mismatch KL", (Line("trainer", "mismatch_kl"),)),
    ("grad norm", (Line("trainer", "grad_norm", "rl"), Line("sft", "grad_norm", "sft"))),
    ("throughput (tokens/s)", (Line("trainer", "tokens_per_s", "trained"), Line("sft", "tokens_per_s", "sft"),
                               Line("orchestrator", "sample_tokens_per_s", "sampled"))),
    ("off-policy lag (steps)", (Line("orchestrator", "off_policy_mean", "mean"),
                                Line("orchestrator", "off_policy_max", "max"))),
)


@dataclass
class Run:
    label: str
    path: Path
    records: list[dict]

    def series(self, line: Line) -> dict[str, list[tuple[int, float]]]:
        """``{name: [(step, value), ...]}`` of the records of ``line``."""
        out: dict[str, list[tuple[int, float]]] = {}
        for record in self.records:
            if record.get("role") != line.role or not isinstance(record.get("step"), int):
                continue
            for name, value in record.items():
                if not _number(value) or not re.fullmatch(line.key, name):
                    continue
                out.setdefault(name, []).append((record["step"], float(value)))
        if line.key.startswith("(") and out:  # pass@k: pass@1 and the largest k of each environment
            out = {name: points for name, points in out.items() if _keep_pass(name, out)}
        return out


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _keep_pass(name: str, all_names) -> bool:
    env, k = name.rsplit("/pass@", 1)
    ks = [int(n.rsplit("@", 1)[1]) for n in all_names if n.startswith(f"{env}/pass@")]
    return int(k) in (1, max(ks))


def load_runs(dirs: list[Path], labels: list[str] | None = None) -> list[Run]:
    if labels and len(labels) != len(dirs):
        raise PrimeError(f"--label was given {len(labels)} times for {len(dirs)} runs: one per OUTPUT_DIR, or none")
    runs = []
    for i, folder in enumerate(dirs):
        path = Path(folder) / METRICS_FILE if Path(folder).is_dir() else Path(folder)
        if not path.is_file():
            raise PrimeError(f"{folder}: no {METRICS_FILE} (not a run's output_dir, or the run logged no step yet)",
                             hint="give the output_dir of a run (`prime run` / `prime sft` write metrics.jsonl there)")
        records = read_jsonl(path)
        if not any(isinstance(r.get("step"), int) for r in records):
            raise PrimeError(f"{path}: no step records yet")
        runs.append(Run(labels[i] if labels else Path(folder).resolve().name, path, records))
    return runs


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}"


def summary(runs: list[Run]) -> str:
    """One block per run: for each panel's lines, the steps, the first, last, best and mean value."""
    out = []
    for run in runs:
        steps = {r["step"] for r in run.records if isinstance(r.get("step"), int)}
        roles = sorted({r.get("role") for r in run.records if r.get("role")})
        out.append(f"{run.label} ({run.path}): steps {min(steps)}..{max(steps)}, roles {', '.join(roles)}")
        out.append(f"  {'metric':44s} {'steps':>6s} {'first':>10s} {'last':>10s} {'min':>10s} {'max':>10s} "
                   f"{'mean':>10s}")
        for panel, lines in PANELS:
            for line in lines:
                for name, points in run.series(line).items():
                    values = [v for _, v in points]
                    shown = f"{panel}: {name}" if name != panel else panel
                    out.append(f"  {shown[:44]:44s} {len(points):6d} {_fmt(values[0]):>10s} {_fmt(values[-1]):>10s} "
                               f"{_fmt(min(values)):>10s} {_fmt(max(values)):>10s} "
                               f"{_fmt(sum(values) / len(values)):>10s}")
    return "\n".join(out)


def plot(runs: list[Run], out: Path) -> Path:
    try:
        import matplotlib
    except ImportError:
        raise PrimeError("drawing the PNG needs matplotlib: pip install matplotlib (or use --no-plot)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(20, 8.5), constrained_layout=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (panel, lines) in zip(axes.flat, PANELS, strict=True):
        drawn = 0
        for r, run in enumerate(runs):
            styles = iter(["-", "--", ":", "-."] * 8)
            for line in lines:
                for name, points in run.series(line).items():
                    steps, values = zip(*points, strict=True)
                    legend = " ".join(p for p in (run.label if len(runs) > 1 else "", line.label,
                                                  name if line.key != name else "") if p)
                    ax.plot(steps, values, next(styles), color=colours[r % len(colours)], label=legend or None,
                            linewidth=1.4, marker="o" if len(points) < 12 else None, markersize=3)
                    drawn += 1
        ax.set_title(panel)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if drawn == 0:
            ax.text(0.5, 0.5, "not in metrics.jsonl", ha="center", va="center", transform=ax.transAxes, color="grey")
        elif any(h.get_label() and not h.get_label().startswith("_") for h in ax.get_lines()):
            ax.legend(fontsize=7)
    fig.suptitle(" vs ".join(run.label for run in runs))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
