"""Hooks of prime-plugin-local: the ``local`` launcher.

Runs every role of ``prime run`` on this machine as a child process: the inference server
first (a service, stopped when the others finish), then the orchestrator and the trainer.
Each role logs to ``output_dir/logs/<role>.log``. With ``deployment.num_train_gpus`` > 1 the
trainer runs as that many processes under torchrun (NCCL on GPUs, gloo on a CPU machine);
each rank also logs to ``output_dir/logs/trainer/rank_N.log``. GPUs are handed out in order,
inference first (``CUDA_VISIBLE_DEVICES`` per role). When a role fails or the user presses
Ctrl-C, every role is stopped and the failing one is named with the end of its log.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from prime_core import hookimpl
from prime_core.specs import Launcher

PRIME_PLUGIN_API = 1


def plan(config, *, output_dir: Path, configs: dict[str, Path]):
    from prime_core.errors import PluginError
    from prime_core.launch.plan import LaunchPlan, RoleProcess, role_command, split_devices

    deployment = config.deployment
    if deployment.type != "single_node":
        raise PluginError(
            f"deployment.type = '{deployment.type}': the local launcher runs on this machine only",
            hint="use a cluster launcher (launcher = 'slurm') for multi-node runs",
        )
    logs = Path(output_dir) / "logs"
    counts = {"inference": deployment.num_infer_gpus if "inference" in configs else 0,
              "trainer": deployment.num_train_gpus}
    gpus = split_devices(counts, os.environ.get("CUDA_VISIBLE_DEVICES"))
    # Checked without importing torch: a GPU machine has the NVIDIA driver's nvidia-smi.
    has_gpus = bool(os.environ.get("CUDA_VISIBLE_DEVICES")) or shutil.which("nvidia-smi") is not None
    result = LaunchPlan(launcher="local", output_dir=Path(output_dir), total_steps=config.max_steps)
    for role in ("inference", "orchestrator", "trainer"):
        if role not in configs:
            continue
        env = dict(config.env_vars)
        if role in counts and has_gpus:
            env.setdefault("CUDA_VISIBLE_DEVICES", gpus[role])
        result.processes.append(RoleProcess(
            role=role,
            # Several trainer processes (GPUs, or gloo processes on a CPU machine) run under torchrun.
            command=role_command(role, configs[role],
                                 processes=deployment.num_train_gpus if role == "trainer" else 1),
            config=configs[role],
            log=logs / f"{role}.log",
            env=env,
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
