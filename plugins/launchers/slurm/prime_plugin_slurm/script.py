"""From a resolved config to an sbatch script: the layout of the job (which role on which
nodes, how many GPUs), the variables a template sees, and the rendering itself.

The templates do the shell work (node lists, logs, supervision); everything decided from
the config is decided here, once, so that a custom template gets the same variables.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prime_core.launch.loopback_rdzv import ARGS as ONE_NODE_RDZV

TEMPLATES = Path(__file__).resolve().parent / "templates"
SINGLE_NODE_TEMPLATE = "single_node.sbatch.j2"
MULTI_NODE_TEMPLATE = "multi_node.sbatch.j2"
TMUX_SCRIPT = Path(__file__).resolve().parent / "scripts" / "slurm_tmux.sh"
ROLE_PROCESS_ENV = "PRIME_ROLE_PROCESS"
"""Marks the processes the job starts as role processes: ``prime sft FILE`` there runs the
loop instead of choosing a launcher again (prime_core.launch.plan names it too)."""

# What a custom template may rely on; the README documents each.
TEMPLATE_VARIABLES = (
    "kind", "multi_node", "job_name", "partition", "account", "time", "nodelist", "exclusive",
    "request_gpus", "sbatch_options", "project_dir", "output_dir", "config_dir", "log_dir",
    "python", "pre_run_command", "hf_hub_offline", "env", "num_nodes", "num_train_nodes",
    "num_infer_nodes", "gpus_per_node", "num_train_gpus", "num_infer_gpus", "trainer_role",
    "trainer_config", "orchestrator_config", "inference_config", "inference_port",
    "inference_replicas", "bind_inference", "infer_gpu_ids", "train_gpu_ids", "rdzv_port", "torchrun_log_dir",
    "role_process_env", "script_path",
)


def root_of(config: Any) -> str:
    """``rl``, ``sft`` or ``inference``: which command's config this is."""
    if hasattr(config, "trainer") and hasattr(config, "orchestrator"):
        return "rl"
    if hasattr(config, "server") and hasattr(config, "backend"):
        return "inference"
    return "sft"


@dataclass(frozen=True)
class Layout:
    """Where the roles of one job run."""

    kind: str
    multi_node: bool
    num_train_nodes: int  # nodes running the trainer (sft: all nodes)
    num_infer_nodes: int  # nodes running an inference server (single node: 1 when it runs)
    gpus_per_node: int  # GPUs requested per node
    num_train_gpus: int  # trainer processes per train node
    num_infer_gpus: int  # GPUs of the server on its node (single node: taken first)

    @property
    def num_nodes(self) -> int:
        if not self.multi_node:
            return 1
        if self.kind == "rl":
            return self.num_train_nodes + self.num_infer_nodes
        return self.num_train_nodes or self.num_infer_nodes


def layout(config: Any, root: str, roles: set[str]) -> Layout:
    """The job's layout from ``config.deployment``; ``roles`` are the roles that run
    (an RL run with ``inference = None`` or ``--bench`` starts no server)."""
    d = config.deployment
    multi = d.type == "multi_node"
    if root == "rl":
        serve = "inference" in roles
        if multi:
            infer_nodes = d.num_infer_nodes if serve else 0
            return Layout("rl", True, d.num_train_nodes, infer_nodes, d.gpus_per_node, d.gpus_per_node,
                          d.gpus_per_node if infer_nodes else 0)
        infer = d.num_infer_gpus if serve else 0
        gpus = d.num_train_gpus + infer
        served = (getattr(d, "inference_gpu_ids", None) or []) if serve else []
        named = (getattr(d, "trainer_gpu_ids", None) or []) + served
        if named and all(isinstance(i, int) for i in named) and getattr(d, "trainer_gpu_ids", None) \
                and (not serve or getattr(d, "inference_gpu_ids", None)):
            gpus = max(named) + 1  # every role names its GPUs (two roles may share one)
        return Layout("rl", False, 1, 1 if serve else 0, gpus, d.num_train_gpus, infer)
    if root == "sft":
        if multi:
            return Layout("sft", True, d.num_nodes, 0, d.gpus_per_node, d.gpus_per_node, 0)
        return Layout("sft", False, 1, 0, d.num_gpus, d.num_gpus, 0)
    if multi:
        return Layout("inference", True, 0, d.num_nodes, d.gpus_per_node, 0, d.gpus_per_node)
    return Layout("inference", False, 0, 1, d.num_gpus, 0, d.num_gpus)


def template_context(config: Any, *, root: str, lay: Layout, output_dir: Path, configs: dict[str, Path],
                     script_path: Path) -> dict[str, Any]:
    """The variables every template (default or custom) is rendered with."""
    slurm = config.slurm
    out = Path(output_dir).resolve()
    project = Path(slurm.project_dir or Path.cwd()).resolve()
    trainer_role = {"rl": "trainer", "sft": "sft"}.get(root)
    trainer_config = configs.get(trainer_role) if trainer_role else None
    server = config.inference if root == "rl" else (config if root == "inference" else None)
    inference_config = configs.get("inference")
    replicas = []
    if server is not None and inference_config and lay.num_infer_nodes:
        # `parallel.dp` replicas on every inference node, each its own config, port and `tp` GPUs.
        from prime_core.inference.replicas import replicas as replicas_of

        found, tp = replicas_of(server, Path(inference_config)), server.parallel.tp
        replicas = [{"index": r.index, "config": str(r.config), "port": r.port, "first_gpu": r.index * tp,
                     "num_gpus": tp, "suffix": f"_replica_{r.index}" if len(found) > 1 else ""} for r in found]
    env = dict(getattr(config, "env_vars", None) or {})
    d = config.deployment

    def ids(key: str) -> str | None:  # the older docs' --inference-gpu-ids / --trainer-gpu-ids
        value = getattr(d, key, None)
        return ",".join(str(v) for v in value) if value else None
    return {
        "kind": root,
        "multi_node": lay.multi_node,
        "job_name": slurm.job_name,
        "partition": slurm.partition,
        "account": slurm.account,
        "time": slurm.time,
        "nodelist": slurm.nodelist,
        "exclusive": slurm.exclusive,
        "request_gpus": slurm.request_gpus and lay.gpus_per_node > 0,
        "sbatch_options": dict(slurm.sbatch_options),
        "project_dir": str(project),
        "output_dir": str(out),
        "config_dir": str(out / "configs"),
        "log_dir": str(out / "slurm"),
        "python": slurm.python or sys.executable,
        "pre_run_command": slurm.pre_run_command,
        "hf_hub_offline": slurm.hf_hub_offline,
        "env": env,
        "num_nodes": lay.num_nodes,
        "num_train_nodes": lay.num_train_nodes,
        "num_infer_nodes": lay.num_infer_nodes,
        "gpus_per_node": lay.gpus_per_node,
        "num_train_gpus": lay.num_train_gpus,
        "num_infer_gpus": lay.num_infer_gpus,
        "trainer_role": trainer_role,
        "trainer_config": str(trainer_config) if trainer_config and lay.num_train_nodes else None,
        "orchestrator_config": str(configs["orchestrator"]) if root == "rl" and "orchestrator" in configs else None,
        "inference_config": str(inference_config) if inference_config and lay.num_infer_nodes else None,
        "inference_port": server.server.port if server is not None else None,
        "inference_replicas": replicas,
        # Servers other nodes reach bind the address their node's name resolves to (the one the
        # orchestrator connects to), unless the config names a host.
        "bind_inference": server is not None and "host" not in server.server.model_fields_set
        and (lay.multi_node or root == "inference"),
        "infer_gpu_ids": ids("inference_gpu_ids"),
        "train_gpu_ids": ids("trainer_gpu_ids"),
        "rdzv_port": slurm.rdzv_port,
        "one_node_rdzv": " ".join(ONE_NODE_RDZV),  # loopback only (prime_core.launch.loopback_rdzv)
        "torchrun_log_dir": str(out / "logs" / (trainer_role or "trainer") / "torchrun"),
        "role_process_env": ROLE_PROCESS_ENV,
        "script_path": str(Path(script_path).resolve()),
    }


def _sbatch_option(key: str, value: Any) -> str:
    flag = "--" + key.replace("_", "-") if not key.startswith("-") else key
    if value is True:
        return flag
    return f"{flag}={value}"


def environment(template_path: Path | None):
    import jinja2

    search = [str(TEMPLATES)]
    if template_path is not None:
        search.insert(0, str(Path(template_path).resolve().parent))
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(search),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
        # bash's ${#array[@]} must not open a Jinja comment: comments are {## ... ##}.
        comment_start_string="{##",
        comment_end_string="##}",
    )
    env.filters["q"] = lambda value: shlex.quote(str(value))
    env.filters["sbatch_option"] = lambda item: _sbatch_option(*item)
    return env


def render(context: dict[str, Any], template_path: Path | None) -> str:
    """Render the default template for the layout, or ``slurm.template_path``."""
    import jinja2

    from prime_core.errors import PluginError

    env = environment(template_path)
    name = Path(template_path).name if template_path else (
        MULTI_NODE_TEMPLATE if context["multi_node"] else SINGLE_NODE_TEMPLATE)
    where = f"slurm.template_path = {template_path}" if template_path else f"the default template {name}"
    try:
        return env.get_template(name).render(**context)
    except jinja2.UndefinedError as exc:
        raise PluginError(
            f"{where}: {exc.message}",
            hint=f"templates get these variables: {', '.join(TEMPLATE_VARIABLES)}",
        ) from None
    except jinja2.TemplateSyntaxError as exc:
        raise PluginError(f"{where}, line {exc.lineno}: {exc.message}",
                          hint="fix the Jinja2 syntax (see the default templates for a starting point)") from None


def write_executable(path: Path, text: str) -> None:
    from prime_core.run_dir import atomic_write_text

    atomic_write_text(path, text)
    os.chmod(path, 0o755)
