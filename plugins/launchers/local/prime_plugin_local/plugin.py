"""Hooks of prime-plugin-local: the ``local`` launcher.

Runs every role of ``prime run`` on this machine as a child process: the inference server
first (a service, stopped when the others finish), then the orchestrator and the trainer.
Each role logs to ``output_dir/logs/<role>.log``. When a role fails or the user presses
Ctrl-C, every role is stopped and the failing one is named with the end of its log.
"""

from __future__ import annotations

from pathlib import Path

from prime_core import hookimpl
from prime_core.specs import Launcher

PRIME_PLUGIN_API = 1


def plan(config, *, output_dir: Path, configs: dict[str, Path]):
    from prime_core.errors import PluginError
    from prime_core.launch.plan import LaunchPlan, RoleProcess, role_command

    deployment = config.deployment
    if deployment.type != "single_node":
        raise PluginError(
            f"deployment.type = '{deployment.type}': the local launcher runs on this machine only",
            hint="use a cluster launcher (launcher = 'slurm') for multi-node runs",
        )
    if deployment.num_train_gpus > 1:
        raise PluginError(
            f"deployment.num_train_gpus = {deployment.num_train_gpus}: the local launcher starts one "
            "trainer process; a multi-process trainer needs the torchrun launcher",
        )
    logs = Path(output_dir) / "logs"
    result = LaunchPlan(launcher="local", output_dir=Path(output_dir), total_steps=config.max_steps)
    for role in ("inference", "orchestrator", "trainer"):
        if role not in configs:
            continue
        result.processes.append(RoleProcess(
            role=role,
            command=role_command(role, configs[role]),
            config=configs[role],
            log=logs / f"{role}.log",
            env=dict(config.env_vars),
            service=role == "inference",
        ))
    if "inference" not in configs:
        result.notes.append("inference = None: the orchestrator uses the servers in orchestrator.client.base_url")
    return result


def launch(plan) -> int:
    from rich.console import Console

    from prime_core.launch.progress import RunProgress
    from prime_core.launch.supervise import supervise
    from prime_core.metrics import METRICS_FILE

    console = Console(stderr=True, highlight=False)
    for process in plan.processes:
        console.print(f"starting {process.role} (log: {process.log})", markup=False)
    with RunProgress(plan.output_dir / METRICS_FILE, plan.total_steps) as progress:
        outcome = supervise(plan, on_tick=progress.tick)
    if outcome.code:
        console.print("error:", style="bold red", end=" ")
        console.print(outcome.message, markup=False)
    else:
        console.print(f"run finished: outputs in {plan.output_dir}", markup=False)
    return outcome.code


@hookimpl
def prime_launchers():
    return [Launcher(name="local", plan=plan, launch=launch, description="every role on this machine")]


@hookimpl(trylast=True)
def prime_select_launcher(config):
    return "local"
