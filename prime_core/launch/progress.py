"""Live progress of a run, read from ``metrics.jsonl`` while the roles work.

On a terminal it is a rich progress bar with the latest reward, throughput, off-policy counts
and, with several inference replicas, how many are up and the requests each served in the
last step; elsewhere (CI, a log file) one plain line per trainer step.
"""

from __future__ import annotations

from pathlib import Path

from prime_core.metrics import parse_record


class RunProgress:
    def __init__(self, metrics_path: Path, total: int | None) -> None:
        from rich.console import Console

        self.path = metrics_path
        self.total = total
        self.offset = 0
        self.latest: dict[str, dict] = {}
        self.console = Console(stderr=True, highlight=False, soft_wrap=True)
        self.progress = None
        self.task = None

    def __enter__(self) -> RunProgress:
        if self.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
                                     TimeElapsedColumn(), TextColumn("{task.fields[info]}"), console=self.console)
            self.progress.start()
            self.task = self.progress.add_task("run", total=self.total, info="waiting for the first step")
        return self

    def __exit__(self, *exc) -> None:
        self.tick()
        if self.progress is not None:
            self.progress.stop()

    def _read(self) -> list[dict]:
        if not self.path.exists():
            return []
        if self.path.stat().st_size < self.offset:  # rewritten on resume
            self.offset = 0
        with self.path.open(encoding="utf-8") as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind("\n") + 1]
        self.offset += len(complete.encode("utf-8"))
        return [record for line in complete.splitlines() if line.strip() and (record := parse_record(line)) is not None]

    def info(self) -> str:
        trainer, orch = self.latest.get("trainer", {}), self.latest.get("orchestrator", {})
        parts = []
        if "reward" in orch:
            parts.append(f"reward {orch['reward']:.3f}")
        if "tokens_per_s" in trainer:
            parts.append(f"trainer {trainer['tokens_per_s']:.0f} tok/s")
        if "sample_tokens_per_s" in orch:
            parts.append(f"sampling {orch['sample_tokens_per_s']:.0f} tok/s")
        if "off_policy_max" in orch:
            parts.append(f"off-policy max {orch['off_policy_max']} dropped {orch.get('dropped_total', 0)}")
        if orch.get("replicas", 1) > 1 or orch.get("replicas_up", 1) < orch.get("replicas", 1):
            counts = [str(v) for k, v in orch.items() if k.startswith("replica_requests/")]
            parts.append(f"replicas {orch['replicas_up']}/{orch['replicas']} up"
                         + (f", requests {'/'.join(counts)}" if counts else ""))
        return " | ".join(parts)

    def note(self, text: str) -> None:
        """A line above the progress bar (or among the step lines)."""
        self.console.print(text, markup=False, style="yellow")

    def tick(self) -> None:
        for record in self._read():
            role = record.get("role", "")
            self.latest[role] = record
            if role != "trainer":
                continue
            if self.progress is not None:
                self.progress.update(self.task, completed=record["step"], info=self.info())
            else:
                total = f"/{self.total}" if self.total else ""
                self.console.print(f"step {record['step']}{total} | {self.info()}", markup=False)
