"""What a launcher produces: the resolved per-role configs on disk and the processes to start.

``prime run``, ``prime sft`` and ``prime inference`` always write ``output_dir/configs/`` (the
root config as ``<root>.json``, plus one JSON file per role of an RL run, each loadable on its
own with ``prime <role> FILE``) and ``output_dir/configs/plan.json``; ``--dry-run`` stops there.

A process a launcher starts is a *role process*: ``prime sft FILE`` / ``prime inference FILE``
run their loop there instead of choosing a launcher again. Launchers mark them with
``PRIME_ROLE_PROCESS=1`` (torchrun ranks are recognised by torchrun's own variables); a
script-writing launcher (SLURM) must export it too.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from prime_core.config.shared import ROLES
from prime_core.run_dir import atomic_write_text

TEACHER = "teacher_inference"
"""The teacher's server of an RL run (``prime_core.config.teacher``): ``prime inference`` on
``configs/teacher_inference.json``, a service like the student's servers."""

ROLE_PROCESS_ENV = "PRIME_ROLE_PROCESS"
"""Set to ``1`` in every process a launcher starts: run the role, do not launch again."""


def is_role_process(environ=None) -> bool:
    """True in a process a launcher started (``PRIME_ROLE_PROCESS=1``) or a torchrun rank."""
    environ = os.environ if environ is None else environ
    return environ.get(ROLE_PROCESS_ENV) == "1" or "TORCHELASTIC_RUN_ID" in environ


@dataclass
class RoleProcess:
    """One process to start. ``service`` roles (inference) run until the others finish."""

    role: str
    command: list[str]
    config: Path
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    service: bool = False
    may_fail: bool = False
    """Its exit, whatever the code, does not end the run: the launcher says so and goes on with
    the others (an inference replica when ``orchestrator.client.on_replica_failure`` is
    ``continue``: the orchestrator carries on with the replicas left)."""
    port: int | None = None
    """The port it serves on (on this machine): the placement table shows it (plugins' services),
    and a failing run asks it for ``/health`` before waiting for a service to fail too
    (``supervise.answering``)."""
    console: bool = False
    """Its output goes to this terminal (``prime sft``: rank 0, as torchrun's
    ``--local-ranks-filter 0``); ``log`` is then the file the process writes itself."""

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
    node_rank: int = 0
    """Which node this plan starts (launchers run once per node, e.g. torchrun across nodes):
    node 0 writes ``configs/plan.json``, node K ``configs/plan.node_K.json``."""
    inline: bool = False
    """One role run in this very process (``prime sft`` on one device, ``prime inference``
    on one node): the launcher calls the role's loop instead of starting a child."""
    placement: list[dict] = field(default_factory=list)
    """What runs where, one row per role (or replica): ``role``, ``node``, ``gpus``, ``ranks``,
    ``port``, ... as the launcher decides; printed before launch and kept in ``plan.json``."""

    def to_json(self) -> dict:
        data = asdict(self)
        data["commands"] = [p.shell() for p in self.processes]
        return json.loads(json.dumps(data, default=str))


def role_command(role: str, config_path: Path, *, processes: int = 1) -> list[str]:
    """How any launcher starts a role: the same ``prime <role> FILE`` a user would type, under
    torchrun (one machine, a free rendezvous port) when the role runs as several processes."""
    return [*python_command(processes), "-m", "prime_core", role, str(config_path)]


def python_command(processes: int = 1) -> list[str]:
    """This Python, or torchrun starting ``processes`` copies on this machine (its rendezvous on a
    free port of loopback: ``prime_core.launch.loopback_rdzv``)."""
    from prime_core.launch.loopback_rdzv import ARGS

    if processes > 1:
        return [sys.executable, "-m", "torch.distributed.run", *ARGS, "--nproc-per-node", str(processes)]
    return [sys.executable]


def cli_flags(options: dict[str, Any], *, repeated: tuple[str, ...] = ()) -> list[str]:
    """A server's options as command-line flags: ``{"max_num_seqs": 4, "enforce_eager": True}``
    -> ``["--max-num-seqs", "4", "--enforce-eager"]``.

    ``True`` is a bare flag, ``False`` and ``None`` are left out, a list gives its values after
    one flag (``nargs='+'``; an empty list gives nothing) or, for the keys in ``repeated``, the
    flag once per value; a dict is passed as JSON."""
    argv: list[str] = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            if key in repeated:
                for item in value:
                    argv += [flag, str(item)]
            elif value:
                argv += [flag, *(json.dumps(v) if isinstance(v, dict) else str(v) for v in value)]
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def role_config_paths(config: BaseModel, output_dir: Path, root: str = "rl") -> dict[str, Path]:
    """Where ``write_role_configs`` puts each file: ``configs/<root>.json``, plus for an RL
    run one file per role present in ``config``."""
    configs = Path(output_dir) / "configs"
    paths = {root: configs / f"{root}.json"}
    if root == "rl":
        paths.update({role: configs / f"{role}.json" for role in (*ROLES, TEACHER)
                      if isinstance(getattr(config, role, None), BaseModel)})
    return paths


def write_role_configs(config: BaseModel, output_dir: Path, root: str = "rl") -> dict[str, Path]:
    """Write the files of ``role_config_paths``; the root file without ``dry_run``, so that it
    runs for real. Several inference replicas also get one file each
    (``prime_core.inference.replicas``)."""
    from prime_core.inference.replicas import write_replicas

    paths = role_config_paths(config, output_dir, root)
    for name, path in paths.items():
        section = config if name == root else getattr(config, name)
        data = section.model_dump(mode="json")
        if name == root:
            data.pop("dry_run", None)
        atomic_write_text(path, json.dumps(data, indent=2) + "\n")
        if name == "inference":
            write_replicas(data, path)
    return paths


def teacher_process(config: BaseModel, configs: dict[str, Path], logs: Path, env: dict[str, str]) -> RoleProcess | None:
    """The teacher's server of an RL run, when it has one: ``prime inference`` on its own config
    file, a service (stopped when the others finish) whose end stops the run."""
    server = getattr(config, TEACHER, None)
    if server is None or TEACHER not in configs:
        return None
    return RoleProcess(role=TEACHER, command=role_command("inference", configs[TEACHER]), config=configs[TEACHER],
                       log=logs / f"{TEACHER}.log", env=env, service=True, port=server.server.port)


def plugin_services(config: BaseModel, root: str, configs: dict[str, Path]) -> list[RoleProcess]:
    """The processes plugins add to this launch (``prime_services``), ordered by role name."""
    from prime_core.plugins import get_plugin_manager

    answers = get_plugin_manager().hook.prime_services(config=config, root=root, configs=configs)
    return sorted((process for answer in answers for process in answer or ()), key=lambda p: p.role)


THIS_MACHINE = {"localhost", "127.0.0.1", "0.0.0.0", "::1", "::"}
"""Hosts in a URL that name this machine (loopback and the wildcard binds)."""


def stray_client_note(urls: list[str], ports: set[int]) -> str | None:
    """A note when the orchestrator is pointed at a port of this machine that no server of this
    run listens on: it would sample from whatever does (another run's server, say) while this
    run's weights go to its own servers. A note, not a refusal: a proxy of the user's own may
    sit there."""
    from urllib.parse import urlsplit

    stray = []
    for url in urls:
        try:
            parts = urlsplit(url)
            host, port = parts.hostname, parts.port
        except ValueError:
            continue  # the orchestrator's client reports a malformed URL
        if host in THIS_MACHINE and port is not None and port not in ports:
            stray.append(url)
    if not stray:
        return None
    return (f"orchestrator.client.base_url {', '.join(stray)} is on this machine, but no server of this run listens "
            f"there (this run's: port {', '.join(str(p) for p in sorted(ports))}); the orchestrator will sample from "
            "whatever does, while this run's weight updates go to its own servers. Unset base_url to use them")


def replicas_may_fail(config: BaseModel, root: str, count: int) -> bool:
    """Whether an inference replica's process may end without ending the run: several replicas
    in ``prime run`` with ``orchestrator.client.on_replica_failure = "continue"``."""
    client = getattr(getattr(config, "orchestrator", None), "client", None)
    return root == "rl" and count > 1 and getattr(client, "on_replica_failure", "stop") == "continue"


def write_plan(plan: LaunchPlan) -> Path:
    name = "plan.json" if not plan.node_rank else f"plan.node_{plan.node_rank}.json"
    path = plan.output_dir / "configs" / name
    atomic_write_text(path, json.dumps(plan.to_json(), indent=2) + "\n")
    return path
