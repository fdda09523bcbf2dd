"""What a launcher produces: the resolved per-role configs on disk and the processes to start.

``prime run`` always writes ``output_dir/configs/`` (one JSON file per role, each loadable on
its own with ``prime <role> FILE``) and ``output_dir/configs/plan.json``; ``--dry-run``
stops there.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pydantic import BaseModel

from prime_core.config.rl import ROLES


@dataclass
class RoleProcess:
    """One process to start. ``service`` roles (inference) run until the others finish."""

    role: str
    command: list[str]
    config: Path
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    service: bool = False

    def shell(self) -> str:
        """The command as a user would type it (``prime trainer outputs/configs/trainer.json``)."""
        argv = list(self.command)
        if argv[:3] == [sys.executable, "-m", "prime_core"]:
            argv = ["prime", *argv[3:]]
        elif argv[:3] == [sys.executable, "-m", "torch.distributed.run"]:
            argv = ["torchrun", *argv[3:]]
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return f"{env} {shlex.join(argv)}".strip()


@dataclass
class LaunchPlan:
    launcher: str
    output_dir: Path
    processes: list[RoleProcess] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    script: Path | None = None
    """For launchers that submit a script (SLURM): the rendered script."""
    total_steps: int | None = None
    """For progress displays: the trainer steps the run will take."""

    def to_json(self) -> dict:
        data = asdict(self)
        data["commands"] = [p.shell() for p in self.processes]
        return json.loads(json.dumps(data, default=str))


def role_command(role: str, config_path: Path, *, processes: int = 1) -> list[str]:
    """How any launcher starts a role: the same ``prime <role> FILE`` a user would type, under
    torchrun (one machine, a free rendezvous port) when the role runs as several processes."""
    return [*python_command(processes), "-m", "prime_core", role, str(config_path)]


def python_command(processes: int = 1) -> list[str]:
    """This Python, or torchrun starting ``processes`` copies on this machine (free port)."""
    if processes > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)]
    return [sys.executable]


def split_devices(counts: dict[str, int], visible: str | None) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` per role: the visible GPUs (all of them when unset) in order,
    ``counts[role]`` each (inference first, as ``deployment`` documents)."""
    pool = [d for d in (visible or "").split(",") if d.strip()] or [str(i) for i in range(sum(counts.values()))]
    out, start = {}, 0
    for role, count in counts.items():
        out[role] = ",".join(pool[start:start + count])
        start += count
    return out


def atomic_write_text(path: Path, text: str) -> None:
    """Write through a temporary file and rename, so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def dump_config(config: BaseModel) -> str:
    return json.dumps(config.model_dump(mode="json"), indent=2) + "\n"


def write_role_configs(config: BaseModel, output_dir: Path) -> dict[str, Path]:
    """``configs/rl.json`` plus one file per role present in ``config``."""
    configs = output_dir / "configs"
    paths = {"rl": configs / "rl.json"}
    atomic_write_text(paths["rl"], dump_config(config))
    for role in ROLES:
        section = getattr(config, role, None)
        if isinstance(section, BaseModel):
            paths[role] = configs / f"{role}.json"
            atomic_write_text(paths[role], dump_config(section))
    return paths


def write_plan(plan: LaunchPlan) -> Path:
    path = plan.output_dir / "configs" / "plan.json"
    atomic_write_text(path, json.dumps(plan.to_json(), indent=2) + "\n")
    return path
