"""Hooks of prime-plugin-local: the ``local`` launcher.

Runs every role on this machine as child processes.

- ``prime run``: the inference servers first (services, stopped when the others finish):
  one ``prime inference`` per replica of ``inference.parallel.dp``, on consecutive ports,
  each with its own config file and ``tp`` GPUs; then the orchestrator and the trainer;
  each logs to ``output_dir/logs/<role>.log`` (replica i: ``inference_i.log``); what
  plugins start beside the replicas (``prime_services``: a router in front of them) comes
  next. With several replicas and ``orchestrator.client.on_replica_failure = "continue"``, a
  replica that dies is noted and the run goes on with the others. With
  ``deployment.num_train_gpus`` > 1 the trainer runs as that many processes under torchrun
  (NCCL on GPUs, gloo on a CPU machine), each rank also logging to
  ``output_dir/logs/trainer/rank_N.log``.
- ``prime sft``: one process runs in this very process, as it always did; several run under
  torchrun with rank 0 on the console and every rank in ``output_dir/logs/sft/rank_N.log``.
- ``prime inference``: one replica runs in this process; several (or a plugin's service
  beside it) run as child processes.

GPUs are taken in order from ``CUDA_VISIBLE_DEVICES`` (or every GPU ``nvidia-smi -L``
lists): inference first, trainer next, the teacher's server last (``teacher_inference``, a
service started after the trainer; ``prime_core.launch.placement``). The
placement is printed before launch and kept in ``configs/plan.json``. When a role fails or
the user presses Ctrl-C, every role is stopped and the failing one is named with the end of
its log.
"""

from __future__ import annotations

from pathlib import Path

from prime_core import hookimpl
from prime_core.specs import Launcher

PRIME_PLUGIN_API = 1

def _refuse_multi_node(deployment, root: str) -> None:
    from prime_core.errors import PluginError

    if deployment.type == "single_node":
        return
    hint = {"sft": "start one `prime sft CONFIG --launcher torchrun --torchrun.node-rank K` per node, "
                   "or submit it with launcher = 'slurm'",
            "inference": "each node serves an independent replica: run `prime inference` on each node with "
                         "deployment.type = 'single_node', or submit it with launcher = 'slurm'"}
    raise PluginError(
        f"deployment.type = '{deployment.type}': the local launcher runs on this machine only",
        hint=hint.get(root, "use launcher = 'torchrun' (the trainer across nodes) or launcher = 'slurm'"),
    )


def _requests(config, root: str, configs: dict[str, Path]):
    """What each GPU role asks for (``Request`` per role, in placement order)."""
    from prime_core.launch.placement import Request

    d = config.deployment
    if root == "sft":
        return [Request("sft", d.num_gpus, "deployment.num_gpus")]
    if root == "inference":
        return [Request("inference", d.num_gpus, "deployment.num_gpus")] if d.num_gpus else []

    def ids(name):
        value = getattr(d, name, None)
        return None if value is None else tuple(str(i) for i in value)

    out = []
    if "inference" in configs:
        out.append(Request("inference", d.num_infer_gpus, "deployment.num_infer_gpus", ids("inference_gpu_ids")))
    out.append(Request("trainer", d.num_train_gpus, "deployment.num_train_gpus", ids("trainer_gpu_ids")))
    if "teacher_inference" in configs:  # the teacher's server takes the last GPUs, as in prime-rl
        count = d.num_teacher_gpus if d.num_teacher_gpus is not None else config.teacher_inference.parallel.tp
        out.append(Request("teacher_inference", count, "deployment.num_teacher_gpus"))
    return out


def _inference_section(config, root: str):
    return config if root == "inference" else getattr(config, "inference", None)


def _replicas(config, root: str, configs: dict[str, Path], gpus: dict[str, list[str]] | None):
    """``(role name, Replica, its GPUs or None)`` per inference replica this plan starts."""
    from prime_core.inference.replicas import replicas

    inference = _inference_section(config, root)
    if inference is None or "inference" not in configs:
        return []
    tp, pool = inference.parallel.tp, (gpus or {}).get("inference")
    found = replicas(inference, configs["inference"])
    if len(found) == 1:  # one replica keeps every inference GPU (vLLM's own DP through `args`)
        return [("inference", found[0], pool)]
    return [(f"inference[{r.index}]", r, pool[r.index * tp:(r.index + 1) * tp] if pool is not None else None)
            for r in found]


def _placement_rows(config, root: str, gpus: dict[str, list[str]] | None, configs) -> list[dict]:
    """One row per inference replica and per other role: GPUs, processes, port."""
    from prime_core.launch.config import trainer_processes

    rows = []
    for name, replica, part in _replicas(config, root, configs, gpus):
        rows.append({"role": name, "gpus": ",".join(part) if part is not None else "cpu", "processes": 1,
                     "port": replica.port, "output_dir": str(config.output_dir)})
    if root == "rl" and "orchestrator" in configs:
        base = config.orchestrator.client.base_url
        rows.append({"role": "orchestrator", "gpus": "-", "processes": 1,
                     "port": "→ " + ", ".join(base if isinstance(base, list) else [base]),
                     "output_dir": str(config.output_dir)})
    for role in ("trainer", "sft"):
        if role not in configs or (root == "rl" and role == "sft"):
            continue
        processes = trainer_processes(config.deployment)[0]
        pool = (gpus or {}).get(role)
        rows.append({"role": role, "gpus": ",".join(pool) if pool is not None else "cpu",
                     "processes": processes, "port": "-", "output_dir": str(config.output_dir)})
    if root == "rl" and "teacher_inference" in configs:
        pool = (gpus or {}).get("teacher_inference")
        rows.append({"role": "teacher_inference", "gpus": ",".join(pool) if pool is not None else "cpu",
                     "processes": 1, "port": config.teacher_inference.server.port,
                     "output_dir": str(config.output_dir)})
    return rows


def _placed_gpus(config, root: str, configs: dict[str, Path]) -> dict[str, list[str]] | None:
    """Each GPU role's GPUs on a GPU machine (or with CUDA_VISIBLE_DEVICES set); ``None`` on a CPU one."""
    from prime_core.errors import PrimeError
    from prime_core.launch.placement import assign, shared_memory_problem, visible_gpus

    pool = visible_gpus()
    if pool is None:
        return None
    gpus = assign(_requests(config, root, configs), pool)
    inference = _inference_section(config, root)
    shared = shared_memory_problem(gpus, inference) if root == "rl" else None
    if shared is not None:
        raise shared
    if inference is not None and "inference" in gpus:
        need = inference.parallel.tp * inference.parallel.dp
        if need > len(gpus["inference"]):
            key = "deployment.num_infer_gpus" if root == "rl" else "deployment.num_gpus"
            raise PrimeError(
                f"inference.parallel.tp × dp = {inference.parallel.tp} × {inference.parallel.dp} = {need} GPUs, "
                f"but {key} gives inference {len(gpus['inference'])}",
                hint=f"set {key} = {need}, or lower inference.parallel.dp / tp")
    return gpus


def plan(config, *, output_dir: Path, configs: dict[str, Path], root: str = "rl"):
    from prime_core.launch.config import trainer_processes
    from prime_core.launch.plan import (
        LaunchPlan,
        RoleProcess,
        plugin_services,
        replicas_may_fail,
        role_command,
        stray_client_note,
        teacher_process,
    )

    deployment = config.deployment
    _refuse_multi_node(deployment, root)
    output_dir = Path(output_dir)
    logs = output_dir / "logs"
    gpus = _placed_gpus(config, root, configs)
    env_vars = dict(getattr(config, "env_vars", {}) or {})
    result = LaunchPlan(launcher="local", output_dir=output_dir,
                        total_steps=getattr(config, "max_steps", None))
    result.placement = _placement_rows(config, root, gpus, configs)
    services = plugin_services(config, root, configs) if "inference" in configs else []
    after = sum(row["role"].startswith("inference") for row in result.placement)
    result.placement[after:after] = [{"role": p.role, "gpus": "-", "processes": 1, "port": p.port or "-",
                                      "output_dir": str(config.output_dir)} for p in services]
    if root == "rl" and "inference" in configs:
        served = {row["port"] for row in result.placement if isinstance(row["port"], int)}
        note = stray_client_note(list(config.orchestrator.client.base_url), served)
        result.notes += [note] if note else []

    def env_for(role: str) -> dict[str, str]:
        env = dict(env_vars)
        if gpus is not None and role in gpus:
            env.setdefault("CUDA_VISIBLE_DEVICES", ",".join(gpus[role]))
        return env

    def inference_processes(service: bool) -> list:
        """One ``prime inference`` per replica, each on its own config, port and GPUs; then what
        plugins start beside them (a router in front of them)."""
        out = []
        found = _replicas(config, root, configs, gpus)
        for name, replica, part in found:
            env = dict(env_vars)
            if part is not None:
                env.setdefault("CUDA_VISIBLE_DEVICES", ",".join(part))
            out.append(RoleProcess(
                role=name, command=role_command("inference", replica.config), config=replica.config,
                log=logs / ("inference.log" if name == "inference" else f"inference_{replica.index}.log"),
                env=env, service=service, may_fail=replicas_may_fail(config, root, len(found)), port=replica.port))
        return out + [_with_env(p, env_vars) for p in services]

    if root == "inference" and (config.parallel.dp > 1 or services):
        # Several processes (replicas, a router): each its own, supervised like the roles of `prime run`.
        result.processes.extend(inference_processes(service=False))
        return result
    if root in ("sft", "inference"):
        processes = trainer_processes(deployment)[0] if root == "sft" else 1
        result.inline = processes == 1
        result.processes.append(RoleProcess(
            role=root, command=role_command(root, configs[root], processes=processes), config=configs[root],
            # Several ranks write logs/sft/rank_N.log themselves (rank 0 also to the console).
            log=logs / root / "rank_0.log" if processes > 1 else logs / f"{root}.log",
            env=env_for(root), console=True, service=False))
        return result
    result.processes.extend(inference_processes(service=True))
    for role in ("orchestrator", "trainer"):
        if role not in configs:
            continue
        result.processes.append(RoleProcess(
            role=role,
            # Several trainer processes (GPUs, or gloo processes on a CPU machine) run under torchrun.
            command=role_command(role, configs[role],
                                 processes=deployment.num_train_gpus if role == "trainer" else 1),
            config=configs[role],
            log=logs / f"{role}.log",
            env=env_for(role),
        ))
    teacher = teacher_process(config, configs, logs, env_for("teacher_inference"))
    if teacher is not None:
        result.processes.append(teacher)
    if "inference" not in configs and not getattr(config, "bench", None):
        result.notes.append("inference = None: the orchestrator uses the servers in orchestrator.client.base_url")
    return result


def _with_env(process, env_vars: dict[str, str]):
    """A plugin's process gets the run's ``env_vars`` too (its own values win)."""
    process.env = {**env_vars, **process.env}
    return process


def launch(plan) -> int:
    from prime_core.launch.supervise import run_here

    return run_here(plan)


@hookimpl
def prime_launchers():
    return [Launcher(name="local", plan=plan, launch=launch, description="every role on this machine")]


@hookimpl(trylast=True)
def prime_select_launcher(config):
    return "local"
