"""Hooks of prime-plugin-torchrun: the ``torchrun`` launcher.

Starts the trainer of ``prime run``, or ``prime sft``, under torchrun: N processes on one
node, or this node's share of a multi-node job (one ``prime`` invocation per node, as the
seeds do it with torchrun itself)::

    # on every node
    export MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 NCCL_SOCKET_IFNAME=... GLOO_SOCKET_IFNAME=...
    prime sft sft.toml --deployment.num-nodes 2 --deployment.gpus-per-node 8 \\
        --launcher torchrun --torchrun.node-rank 0        # 1 on the second node

Nodes and processes per node come from ``[deployment]``; ``[torchrun]`` (its presence
selects this launcher) says which node this is and where the nodes meet. Per-rank output is
kept by torchrun under ``output_dir/logs/trainer/torchrun/node_K/`` and by the ranks in
``output_dir/logs/<role>/rank_N.log``; the console shows ``local_ranks_filter`` (rank 0).
Network variables (``MASTER_ADDR``, ``NCCL_SOCKET_IFNAME``, ``GLOO_SOCKET_IFNAME``, ...) are
passed to the ranks and recorded in the plan.

For ``prime run``, node 0 also starts the orchestrator, and the inference servers (one per
replica of ``inference.parallel.dp``) when the deployment is single-node (GPUs in order:
inference first, then the trainer); a multi-node deployment's inference runs on its own
nodes (``prime inference configs/inference.json``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from prime_core import hookimpl
from prime_core.specs import ConfigSection, Launcher

PRIME_PLUGIN_API = 1


def _settings(config):
    from prime_plugin_torchrun.config import TorchrunConfig

    return getattr(config, "torchrun", None) or TorchrunConfig()


def layout(config) -> tuple[int, int, str]:
    """``(nnodes, nproc_per_node, keys)`` of the trainer, from ``[deployment]``."""
    from prime_core.launch.config import trainer_processes

    d = config.deployment
    if d.type == "single_node":
        processes, keys = trainer_processes(d)
        return 1, processes, keys
    key = "num_train_nodes" if hasattr(d, "num_train_nodes") else "num_nodes"
    return getattr(d, key), d.gpus_per_node, f"deployment.{key}, deployment.gpus_per_node"


def node_rank(config, environ=None) -> int:
    environ = os.environ if environ is None else environ
    rank = _settings(config).node_rank
    return rank if rank is not None else int(environ.get("NODE_RANK", 0))


def rdzv_endpoint(config, environ=None) -> str | None:
    environ = os.environ if environ is None else environ
    endpoint = _settings(config).rdzv_endpoint
    if endpoint is None and environ.get("MASTER_ADDR"):
        endpoint = f"{environ['MASTER_ADDR']}:{environ.get('MASTER_PORT', '29500')}"
    return endpoint


def torchrun_argv(config, role: str, config_path: Path, log_dir: Path, environ=None) -> list[str]:
    """``python -m torch.distributed.run <flags> -m prime_core <role> <file>`` for this node."""
    from prime_core.errors import PrimeError

    settings = _settings(config)
    nnodes, nproc, keys = layout(config)
    rank = node_rank(config, environ)
    argv = [sys.executable, "-m", "torch.distributed.run"]
    if nnodes == 1:  # its rendezvous on loopback only, unlike --standalone's on every interface
        from prime_core.launch.loopback_rdzv import ARGS

        argv += ARGS
    else:
        endpoint = rdzv_endpoint(config, environ)
        if endpoint is None:
            raise PrimeError(f"{keys} describe {nnodes} nodes, but not where they meet",
                             hint="export MASTER_ADDR and MASTER_PORT (node 0's address and a free port) on "
                                  "every node, or pass --torchrun.rdzv-endpoint HOST:PORT")
        if rank >= nnodes:
            raise PrimeError(f"torchrun.node_rank = {rank} but {keys} describe {nnodes} nodes (ranks 0..{nnodes - 1})",
                             hint="give each node its own rank below the node count")
        argv += ["--nnodes", str(nnodes), "--node-rank", str(rank), "--rdzv-backend", settings.rdzv_backend,
                 "--rdzv-endpoint", endpoint, "--rdzv-id", settings.rdzv_id]
    argv += ["--nproc-per-node", str(nproc), "--max-restarts", str(settings.max_restarts),
             "--log-dir", str(log_dir), "--tee", "3"]
    if settings.local_ranks_filter is not None:
        argv += ["--local-ranks-filter", settings.local_ranks_filter]
    return [*argv, "-m", "prime_core", role, str(config_path)]


def network_env(config, environ=None) -> dict[str, str]:
    from prime_plugin_torchrun.config import NETWORK_ENV

    environ = os.environ if environ is None else environ
    env = {k: environ[k] for k in NETWORK_ENV if environ.get(k)}
    env.update(_settings(config).env)
    return env


def plan(config, *, output_dir: Path, configs: dict[str, Path], root: str = "rl"):
    from prime_core.errors import PluginError
    from prime_core.launch.placement import Request, assign, visible_gpus
    from prime_core.launch.plan import LaunchPlan, RoleProcess, plugin_services, replicas_may_fail, role_command

    if root == "inference":
        raise PluginError("the torchrun launcher starts trainers (prime run, prime sft); inference is a server",
                          hint="use launcher = 'local' (one node) or 'slurm' (one replica per node)")
    output_dir = Path(output_dir)
    logs = output_dir / "logs"
    nnodes, nproc, _ = layout(config)
    rank = node_rank(config)
    role = "sft" if root == "sft" else "trainer"
    single = config.deployment.type == "single_node"
    local_roles = ["inference", "orchestrator"] if root == "rl" and rank == 0 else []
    if not single or getattr(config, "bench", None):
        local_roles = [r for r in local_roles if r != "inference"]
    local_roles = [r for r in local_roles if r in configs]

    requests = []
    if "inference" in local_roles:
        requests.append(Request("inference", config.deployment.num_infer_gpus, "deployment.num_infer_gpus"))
    requests.append(Request(role, nproc, layout(config)[2] if single else "deployment.gpus_per_node"))
    pool = visible_gpus()
    gpus = assign(requests, pool) if pool is not None else None

    env_vars = dict(getattr(config, "env_vars", {}) or {})

    def env_for(name: str, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {**env_vars, **(extra or {})}
        if gpus is not None and name in gpus:
            env.setdefault("CUDA_VISIBLE_DEVICES", ",".join(gpus[name]))
        return env

    result = LaunchPlan(launcher="torchrun", output_dir=output_dir, node_rank=rank,
                        total_steps=getattr(config, "max_steps", None))
    for name in local_roles:
        if name != "inference":
            result.processes.append(RoleProcess(role=name, command=role_command(name, configs[name]),
                                                config=configs[name], log=logs / f"{name}.log", env=env_for(name)))
            continue
        # One `prime inference` per replica (its own config and port), `tp` GPUs each.
        from prime_core.inference.replicas import replicas

        found, tp = replicas(config.inference, configs["inference"]), config.inference.parallel.tp
        several = len(found) > 1
        for replica in found:
            role_name = f"inference[{replica.index}]" if several else "inference"
            if several and gpus is not None:
                gpus[role_name] = gpus["inference"][replica.index * tp:(replica.index + 1) * tp]
            result.processes.append(RoleProcess(
                role=role_name, command=role_command("inference", replica.config), config=replica.config,
                log=logs / (f"inference_{replica.index}.log" if several else "inference.log"),
                env=env_for(role_name), service=True, may_fail=replicas_may_fail(config, root, len(found)),
                port=replica.port))
        # What plugins start beside the replicas (a router in front of them).
        for service in plugin_services(config, root, configs):
            service.env = {**env_for(service.role), **service.env}
            result.processes.append(service)
    first = rank * nproc
    result.processes.append(RoleProcess(
        role=role,
        command=torchrun_argv(config, role, configs[root if root == "sft" else "trainer"],
                              logs / "trainer" / "torchrun" / f"node_{rank}"),
        config=configs[root if root == "sft" else "trainer"],
        log=logs / role / f"rank_{first}.log" if root == "sft" else logs / "trainer.log",
        env=env_for(role, network_env(config)),
        console=root == "sft",
    ))
    for process in result.processes:
        result.placement.append({
            "role": process.role, "node": rank,
            "gpus": ",".join(gpus[process.role]) if gpus is not None and process.role in gpus else
            ("-" if process.role == "orchestrator" else "cpu"),
            "ranks": f"{first}..{first + nproc - 1} of {nnodes * nproc}" if process.role == role else "-",
            "log": str(process.log),
        })
    served = {p.port for p in result.processes if p.port}
    if root == "rl" and served:
        from prime_core.launch.plan import stray_client_note

        note = stray_client_note(list(config.orchestrator.client.base_url), served)
        result.notes += [note] if note else []
    if root == "rl" and rank == 0 and not single and "inference" in configs:
        result.notes.append("multi-node: start the inference servers on their own nodes "
                            f"(prime inference {configs['inference']}) and point orchestrator.client.base_url at them")
    if root == "rl" and rank > 0:
        result.notes.append(f"node {rank}: trainer ranks only; node 0 runs the orchestrator")
    return result


def launch(plan) -> int:
    from prime_core.launch.supervise import run_here

    return run_here(plan)


@hookimpl
def prime_config_sections():
    from prime_plugin_torchrun.config import TorchrunConfig

    return [ConfigSection(name="torchrun", model=TorchrunConfig, roots=("rl", "sft"),
                          description="Start the trainer (or prime sft) under torchrun on this node.")]


@hookimpl
def prime_launchers():
    return [Launcher(name="torchrun", plan=plan, launch=launch,
                     description="the trainer under torchrun, on one node or this node of several")]


@hookimpl
def prime_select_launcher(config):
    # A [torchrun] table asks for this launcher, unless a [slurm] table asks to submit the job
    # (the SLURM launcher runs torchrun inside the allocation itself).
    if getattr(config, "torchrun", None) is not None and getattr(config, "slurm", None) is None:
        return "torchrun"
    return None


@hookimpl
def prime_validate_config(config, root):
    settings = getattr(config, "torchrun", None)
    if settings is None or root not in ("rl", "sft"):
        return
    nnodes, nproc, keys = layout(config)
    if settings.nnodes is not None and settings.nnodes != nnodes:
        yield (f"torchrun.nnodes = {settings.nnodes} but {keys} describe {nnodes} node(s): "
               "set the node count in [deployment] (num_nodes / num_train_nodes) and leave torchrun.nnodes out")
    if settings.nproc_per_node is not None and settings.nproc_per_node != nproc:
        yield (f"torchrun.nproc_per_node = {settings.nproc_per_node} but {keys} give {nproc} processes per node: "
               "set them in [deployment] (num_gpus / num_train_gpus, or gpus_per_node) and leave it out")
