"""Hooks of prime-plugin-slurm: the ``[slurm]`` table and the ``slurm`` launcher.

A config with a ``[slurm]`` table selects this launcher (``prime run``, ``prime sft``,
``prime inference``). Its plan writes ``output_dir/<root>.sh`` from a Jinja2 template (the
single-node or multi-node default, or ``slurm.template_path``) next to the resolved configs
the core writes; ``launch`` submits it with ``sbatch`` and says where the logs will be
(``output_dir/slurm/latest_*.log``). ``--dry-run`` stops after the plan: nothing is submitted.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

from prime_core import hookimpl
from prime_core.specs import ConfigSection, Launcher

PRIME_PLUGIN_API = 1

_LOG_STREAMS = {  # role -> the latest_* logs the tmux helper follows
    "trainer": "latest_train_node_rank_*.log",
    "orchestrator": "latest_orchestrator.log",
    "inference": "latest_infer_node_rank_*.log",
}


def _dump(config, path: Path, **changes) -> Path:
    from prime_core.run_dir import atomic_write_text

    data = config.model_dump(mode="json")
    data.pop("dry_run", None)
    data.update(changes)
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")
    return path


def plan(config, *, output_dir: Path, configs: dict[str, Path], root: str | None = None, **_unused):
    from prime_core.errors import PluginError
    from prime_core.launch.plan import LaunchPlan
    from prime_plugin_slurm.script import TMUX_SCRIPT, layout, render, root_of, template_context, write_executable

    if getattr(config, "slurm", None) is None:
        raise PluginError("launcher = 'slurm' needs a [slurm] table in the config",
                          hint="add [slurm] with at least job_name = \"...\" (see prime-plugin-slurm's README)")
    root = root or root_of(config)
    out = Path(output_dir)
    configs = dict(configs)
    config_dir = out / "configs"
    if root == "sft" and "sft" not in configs:
        configs["sft"] = _dump(config, config_dir / "sft.json")
    elif root == "inference":
        # Every node runs one independent single-node server.
        gpus = getattr(config.deployment, "gpus_per_node", None) or config.deployment.num_gpus
        configs["inference"] = _dump(config, config_dir / "inference_node.json", slurm=None,
                                     deployment={"type": "single_node", "num_gpus": gpus})
        from prime_core.inference.replicas import write_replicas

        # Several replicas per node: inference_node_<i>.json, one per replica.
        write_replicas(json.loads(configs["inference"].read_text()), configs["inference"])
    from prime_core.launch.plan import plugin_services

    extra = plugin_services(config, root, configs) if "inference" in configs else []
    if extra:
        names = ", ".join(p.role for p in extra)
        raise PluginError(f"the slurm launcher does not start plugins' services yet: {names}",
                          hint="leave out the table that asks for them (e.g. inference.router; the orchestrator's "
                               "client-side routers need no process), or run on one node with launcher = 'local'")
    lay = layout(config, root, set(configs))
    script = out / f"{root}.sh"
    context = template_context(config, root=root, lay=lay, output_dir=out, configs=configs, script_path=script)
    write_executable(script, render(context, config.slurm.template_path))

    logs = out / "slurm"
    logs.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(TMUX_SCRIPT, logs / "tmux.sh")
    (logs / "tmux.sh").chmod(0o755)
    streams = [role for role, count in (("trainer", context["trainer_config"]),
                                        ("orchestrator", context["orchestrator_config"]),
                                        ("inference", context["inference_config"])) if count]
    (logs / "panes").write_text("".join(_LOG_STREAMS[role] + "\n" for role in streams))

    result = LaunchPlan(launcher="slurm", output_dir=out, script=script,
                        total_steps=getattr(config, "max_steps", None))
    rows = _placement(lay, context)
    if hasattr(result, "placement"):
        result.placement = rows
    else:
        result.notes.extend(f"{row['role']}: {row['nodes']}, {row['gpus']} (log {row['log']})" for row in rows)
    if config.slurm.template_path:
        template = f"custom template {config.slurm.template_path}"
    else:
        template = f"{'multi-node' if lay.multi_node else 'single-node'} default template"
    result.notes.append(f"sbatch script: {script} ({template})")
    if config.slurm.project_dir and not Path(config.output_dir).is_absolute():
        result.notes.append(f"output_dir {config.output_dir} is relative: the roles resolve it in slurm.project_dir "
                            f"{config.slurm.project_dir}; use an absolute path on the shared filesystem")
    return result


def _placement(lay, context) -> list[dict]:
    rows = []
    log = context["log_dir"]
    if context["inference_config"]:
        replicas = context["inference_replicas"]
        if len(replicas) == 1:
            rows.append({"role": "inference", "nodes": _nodes(lay.num_infer_nodes, lay.multi_node, "one server each"),
                         "gpus": f"{lay.num_infer_gpus} per server", "port": replicas[0]["port"],
                         "log": f"{log}/latest_infer_node_rank_*.log"})
        for r in replicas if len(replicas) > 1 else []:
            ids = ",".join(str(g) for g in range(r["first_gpu"], r["first_gpu"] + r["num_gpus"]))
            rows.append({"role": f"inference[{r['index']}]",
                         "nodes": _nodes(lay.num_infer_nodes, lay.multi_node, "one replica each"),
                         "gpus": f"inference GPU{'s' if r['num_gpus'] > 1 else ''} {ids}", "port": r["port"],
                         "log": f"{log}/latest_infer_node_rank_*{r['suffix']}.log"})
    if context["orchestrator_config"]:
        rows.append({"role": "orchestrator", "nodes": "first train node" if lay.multi_node else "1",
                     "gpus": "0", "log": f"{log}/latest_orchestrator.log"})
    if context["trainer_config"]:
        rows.append({"role": context["trainer_role"],
                     "nodes": _nodes(lay.num_train_nodes, lay.multi_node, "torchrun, rendezvous on the first"),
                     "gpus": f"{lay.num_train_gpus} per node", "log": f"{log}/latest_train_node_rank_*.log"})
    return rows


def _nodes(count: int, multi: bool, how: str) -> str:
    return f"{count} ({how})" if multi and count > 1 else str(count)


def parse_job_id(stdout: str) -> str:
    """``sbatch --parsable`` prints ``JOBID`` or ``JOBID;CLUSTER``."""
    match = re.search(r"^\s*(\d+)(?:;\S+)?\s*$", stdout, re.MULTILINE)
    if not match:
        raise ValueError(f"no job id in sbatch's output: {stdout.strip()!r}")
    return match.group(1)


def _job_name(script: Path) -> str:
    match = re.search(r"^#SBATCH\s+(?:--job-name[= ]|-J\s*)(\S+)", script.read_text(), re.MULTILINE)
    return match.group(1) if match else "prime"


def submit(script: Path) -> str:
    """``sbatch --parsable SCRIPT``; returns the job id."""
    from prime_core.errors import PluginError

    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise PluginError(
            f"sbatch not found on PATH: the job script {script} is written but cannot be submitted from here",
            hint="run this on a SLURM login node (or install the SLURM client, e.g. apt-get install slurm-client), "
                 f"submit it yourself with `sbatch {script}`, or pass --dry-run to only write it",
        )
    result = subprocess.run([sbatch, "--parsable", str(script)], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        why = (result.stderr or result.stdout).strip() or f"exit code {result.returncode}"
        raise PluginError(f"sbatch refused {script}: {why}",
                          hint="check the [slurm] keys it names (partition, account, time, nodelist, "
                               "sbatch_options, request_gpus) or your template")
    try:
        return parse_job_id(result.stdout)
    except ValueError as exc:
        raise PluginError(f"sbatch {script}: {exc}", hint="is `sbatch` SLURM's own?") from None


def launch(plan) -> int:
    from rich.console import Console

    console = Console(highlight=False, soft_wrap=True)  # paths stay whole, to copy
    job_id = submit(plan.script)
    logs = plan.output_dir.resolve() / "slurm"
    with (logs / "submitted.jsonl").open("a") as f:
        f.write(json.dumps({"job_id": job_id, "script": str(plan.script)}) + "\n")
    console.print(f"submitted batch job {job_id} ({plan.script})", markup=False)
    console.print(f"  job log:  {logs}/job_{job_id}.log", markup=False)
    console.print(f"  role logs (once it runs): {logs}/latest_*.log  (this job's: {logs}/job_{job_id}/)", markup=False)
    console.print(f"  follow them in tmux: bash {logs}/tmux.sh {_job_name(plan.script)} {plan.output_dir.resolve()}",
                  markup=False)
    console.print(f"  status: squeue -j {job_id}    cancel: scancel {job_id}", markup=False)
    return 0


@hookimpl
def prime_config_sections():
    return [
        ConfigSection(name="slurm", model="prime_plugin_slurm.config:SlurmConfig", roots=("rl", "sft", "inference"),
                      description="Submit the run to SLURM (sbatch)."),
        ConfigSection(name="", model="prime_plugin_slurm.config:LegacyTopLevelKeys", merge=True, roots=("rl",)),
    ]


@hookimpl
def prime_launchers():
    return [Launcher(name="slurm", plan=plan, launch=launch, remote=True,
                     description="write an sbatch script from a Jinja2 template and submit it")]


@hookimpl
def prime_select_launcher(config):
    return "slurm" if getattr(config, "slurm", None) is not None else None


@hookimpl
def prime_validate_config(config, root):
    if getattr(config, "slurm", None) is None:
        return
    d = getattr(config, "deployment", None)
    server = config.inference if root == "rl" else (config if root == "inference" else None)
    if server is not None and d is not None and d.type == "multi_node":
        per_server = server.parallel.tp * server.parallel.dp
        if per_server > d.gpus_per_node:
            key = "inference.parallel" if root == "rl" else "parallel"
            yield (f"{key}: tp × dp = {per_server} GPUs do not fit in one node (deployment.gpus_per_node = "
                   f"{d.gpus_per_node}): each inference node runs dp replicas of tp GPUs, so lower tp or dp")
    if root == "rl" and d is not None and d.type == "multi_node" and config.inference is not None \
            and d.num_infer_nodes == 0:
        yield ("deployment.num_infer_nodes = 0 but this run starts an inference server: give it nodes, or set "
               "inference = false and point orchestrator.client.base_url at your servers")
