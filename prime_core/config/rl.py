"""The root config of ``prime run``: the three roles plus keys shared between them.

Shared keys set at the top (``model``, ``seq_len``, ``max_steps``, ``output_dir``, ``ckpt``,
``monitors``, ``weight_broadcast``, ``log``, and the top-level tables plugins declare with
``ConfigSection.roles``) are copied into each role that uses them, unless the role sets its
own value, so ``configs/trainer.json`` written by ``--dry-run`` is complete on its own.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Annotated, Any, ClassVar

from pydantic import AliasChoices, Field, model_validator

from prime_core.bench import BenchConfig
from prime_core.config.base import NoSecrets, Noted, Section, Toggle, merge_tables
from prime_core.config.shared import (
    ROLES,
    CkptConfig,
    LogConfig,
    ModelRef,
    Monitors,
    WeightBroadcastConfig,
    looks_like_local_path,
)
from prime_core.inference.config import InferenceConfig
from prime_core.launch.config import (
    Deployment,
    SingleNodeDeployment,
    gpu_ids,
    infer_deployment_type,
    with_deployment_type,
)
from prime_core.orchestrator.config import OrchestratorConfig
from prime_core.trainer.config import TrainerConfig

# shared key -> the roles it propagates to
SHARED_KEYS: dict[str, tuple[str, ...]] = {
    "output_dir": ROLES,
    "model": ROLES,
    "log": ROLES,
    "seq_len": ("trainer", "orchestrator"),
    "max_steps": ("trainer", "orchestrator"),
    "ckpt": ("trainer", "orchestrator"),
    "monitors": ("trainer", "orchestrator"),
    "weight_broadcast": ("trainer", "orchestrator"),
    "resume": ("trainer", "orchestrator"),
    "bench": ("trainer",),
}

# The flat top-level keys of prime-rl's older `rl_slurm` docs, and where they live now.
LEGACY_DEPLOYMENT_KEYS = ("num_train_nodes", "num_infer_nodes", "gpus_per_node", "nodes_per_fsdp_group")
# The older docs' single-node `--trainer-gpu-ids 6,7 --inference-gpu-ids 0,1,2,3,4,5`.
LEGACY_GPU_ID_KEYS = ("trainer_gpu_ids", "inference_gpu_ids")


class RLConfig(Section):
    """``prime run``: inference, orchestrator and trainer, placed by a launcher."""

    output_dir: Path = Path("outputs")
    """Everything a run writes goes here: configs/, logs/, rollouts/, weights/, checkpoints/."""
    model: ModelRef | None = None
    seq_len: int | None = Field(default=None, ge=1)
    max_steps: int | None = Field(default=None, ge=1)
    ckpt: CkptConfig | None = None
    monitors: Monitors | None = None
    """Metric sinks for every role (``["jsonl", ...]``); ``jsonl`` is always written."""
    weight_broadcast: WeightBroadcastConfig | None = None
    log: LogConfig | None = None

    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    orchestrator: OrchestratorConfig = Field(default_factory=OrchestratorConfig)
    inference: Toggle[InferenceConfig] = Field(default_factory=InferenceConfig)
    """The inference server to start; ``None`` when you run your own (set orchestrator.client)."""
    teacher_inference: Toggle[InferenceConfig] = None
    """A teacher's server to start as well (prime-rl 0.5's key; ``deployment.num_teacher_gpus``
    turns it on too): its keys default to ``inference``'s, its port follows the student's
    servers, and ``orchestrator.teacher`` talks to it (``prime_core.config.teacher``)."""
    deployment: Annotated[Deployment, infer_deployment_type] = Field(default_factory=SingleNodeDeployment)

    launcher: str = "auto"
    """Launcher plugin (``local``, ``torchrun``, ``slurm``); ``auto`` lets plugins decide."""
    dry_run: bool = False
    """Write the resolved configs and the launch plan, start nothing."""
    bench: Toggle[BenchConfig] = None
    """``--bench``: benchmark the trainer (as deployed) on fake data; inference and the
    orchestrator are not started."""
    resume: bool = False
    """Continue from the newest complete checkpoint under ``output_dir/checkpoints``."""
    clean: bool = Field(default=False, validation_alias=AliasChoices("clean", "clean_output_dir"))
    """Delete the previous run's outputs in ``output_dir`` before starting (prime-rl's
    ``clean_output_dir``)."""
    experimental: Annotated[dict[str, Any] | None, Noted("prime has no experimental keys")] = None
    env_vars: Annotated[dict[str, str], NoSecrets] = Field(default_factory=dict)
    """Extra environment variables for every role process."""
    required_plugins: list[str] = Field(default_factory=list)
    """Plugin names that must be installed and active, e.g. ``["deepep"]``."""

    shared_keys: ClassVar[dict[str, tuple[str, ...]]] = SHARED_KEYS
    mirrors: ClassVar[dict[str, str]] = {"teacher_inference": "inference"}
    """Fields of the same section as another: plugins' keys mounted on ``inference`` are
    ``teacher_inference``'s too (``prime_core.config.schema.build_schema``)."""
    prime_rl_keys: ClassVar[tuple[str, ...]] = ("max_async_level", "max_model_len", "tokenizer")
    """Top-level keys copied into the roles (plugins' sections with ``roles`` add theirs)."""

    @model_validator(mode="before")
    @classmethod
    def _propagate(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = copy.deepcopy(data)
        _move_legacy_keys(data)
        _move_prime_rl_keys(data)
        for key, roles in cls.shared_keys.items():
            if data.get(key) is None:
                continue
            for role in roles:
                section = data.get(role, {})
                if section is None or section is False:
                    continue  # e.g. `inference = false`: nothing to propagate into
                if section is True:
                    section = {}
                if not isinstance(section, dict):
                    continue  # the schema reports the wrong type
                value = data[key]
                if isinstance(value, dict):
                    section[key] = merge_tables(value, section.get(key, {}))
                else:
                    section.setdefault(key, value)
                data[role] = section
        _replicas_from_deployment(data)
        _replicas_fill_the_inference_gpus(data)
        _point_client_at_server(data)
        from prime_core.config.teacher import point_teacher_at_server

        point_teacher_at_server(data)
        return data

    def problems(self) -> list[str]:
        """Keys that contradict each other (checked once the config is valid; ``config.load``)."""
        from prime_core.config import teacher

        problems = clean_and_resume(self) + teacher.problems(self) + roles_disagree(self)
        inference, sampling = self.inference, self.orchestrator.sampling
        limit = inference.model.max_model_len if inference is not None else None
        if limit is not None and sampling.max_tokens is not None and sampling.max_tokens >= limit:
            problems.append(f"orchestrator.sampling.max_tokens = {sampling.max_tokens} leaves no room for a prompt "
                            f"in inference.model.max_model_len = {limit}: lower max_tokens or raise max_model_len")
        replicas = self.deployment.num_infer_replicas
        if replicas is not None and inference is not None:
            nodes = infer_nodes(self.deployment)
            if replicas % nodes:
                problems.append(f"deployment.num_infer_replicas = {replicas} does not split over num_infer_nodes = "
                                f"{nodes}: each inference node runs the same number of whole replicas")
            elif inference.parallel.dp * nodes != replicas:
                problems.append(f"deployment.num_infer_replicas = {replicas} but inference.parallel.dp = "
                                f"{inference.parallel.dp} on {nodes} inference node(s) makes "
                                f"{inference.parallel.dp * nodes}: give one of them, or make them agree")
        return problems


def _model_name(name: str) -> str:
    return str(Path(name).expanduser().resolve()) if looks_like_local_path(name) else name


def roles_disagree(config) -> list[str]:
    """Shared keys the roles were given different values of (a role's own table, an ``@`` file
    per role, ``--trainer.KEY``): the run would hang, train another model than it serves, or get
    rows longer than the trainer takes, so it is refused, as prime-rl refuses it (a trainer's
    ``seq_len`` may be longer than the orchestrator's)."""
    trainer, orchestrator, inference = config.trainer, config.orchestrator, config.inference
    values = {
        "model.name": {"trainer": _model_name(trainer.model.name), "orchestrator": _model_name(orchestrator.model.name),
                       **({"inference": _model_name(inference.model.name)} if inference is not None else {})},
        "max_steps": {"trainer": trainer.max_steps, "orchestrator": orchestrator.max_steps},
        "weight_broadcast.type": {"trainer": trainer.weight_broadcast.type,
                                  "orchestrator": orchestrator.weight_broadcast.type},
        "ckpt.interval": {"trainer": trainer.ckpt.interval, "orchestrator": orchestrator.ckpt.interval},
    }
    problems = []
    for key, by_role in values.items():
        if len({value for value in by_role.values() if value is not None}) > 1:
            shown = ", ".join(f"{role}.{key} = {value!r}" for role, value in by_role.items())
            problems.append(f"{shown}: the roles must agree; set the top-level {key} (every role reads it) and "
                            f"drop the roles' own values")
    if trainer.seq_len < orchestrator.seq_len:
        problems.append(f"trainer.seq_len = {trainer.seq_len} is shorter than orchestrator.seq_len = "
                        f"{orchestrator.seq_len}, the rows it packs: set the top-level seq_len, or raise the trainer's")
    return problems


def clean_and_resume(config) -> list[str]:
    if config.clean and config.resume:
        return ["clean = true and resume = true contradict each other (--clean deletes the run --resume would "
                "continue): give one of them"]
    return []


def _move_legacy_keys(data: dict) -> None:
    ids = {k: data.pop(k) for k in LEGACY_GPU_ID_KEYS if k in data}
    if ids and isinstance(data.setdefault("deployment", {}), dict):
        for k, v in ids.items():
            data["deployment"].setdefault(k, v)
    legacy = {k: data.pop(k) for k in LEGACY_DEPLOYMENT_KEYS if k in data}
    if legacy:
        deployment = data.setdefault("deployment", {})
        if isinstance(deployment, dict):
            deployment.setdefault("type", "multi_node")
            for k, v in legacy.items():
                deployment.setdefault(k, v)


def infer_nodes(deployment) -> int:
    return getattr(deployment, "num_infer_nodes", 1) if deployment.type == "multi_node" else 1


def _replicas_from_deployment(data: dict) -> None:
    """``deployment.num_infer_replicas`` (prime-rl) sets ``inference.parallel.dp``: the replicas
    of one inference node (``problems`` reports a count that disagrees or does not split)."""
    deployment, inference = data.get("deployment"), data.get("inference", {})
    if not isinstance(deployment, dict) or deployment.get("num_infer_replicas") is None:
        return
    if inference is True:
        inference = data["inference"] = {}
    if not isinstance(inference, dict) or not isinstance(inference.setdefault("parallel", {}), dict):
        return
    try:
        replicas = int(deployment["num_infer_replicas"])
        nodes = int(deployment.get("num_infer_nodes", 1))  # a single-node deployment has no such key
    except (TypeError, ValueError):
        return  # the schema reports the bad value
    if nodes > 0 and replicas % nodes == 0:
        inference["parallel"].setdefault("dp", replicas // nodes)
    data["inference"] = inference


def _replicas_fill_the_inference_gpus(data: dict) -> None:
    """``inference.parallel.dp`` unset: as many replicas of ``tp`` GPUs as the inference GPUs
    hold (``deployment.num_infer_gpus`` or ``inference_gpu_ids``; ``gpus_per_node`` on each
    inference node), as prime-rl derives it (one server of one GPU on six left five idle)."""
    deployment, inference = data.get("deployment"), data.get("inference", {})
    if not isinstance(deployment, dict) or inference is None or inference is False:
        return
    inference = {} if inference is True else inference
    parallel = inference.get("parallel", {}) if isinstance(inference, dict) else None
    if not isinstance(parallel, dict) or "dp" in parallel:
        return
    try:
        deployment = with_deployment_type(deployment)
        tp = int(parallel.get("tp", 1))
        if deployment.get("type") == "multi_node":
            gpus = int(deployment.get("gpus_per_node", 8))
        elif deployment.get("inference_gpu_ids") is not None:
            gpus = len(gpu_ids(deployment["inference_gpu_ids"]))
        else:
            gpus = int(deployment.get("num_infer_gpus", 1))
    except (TypeError, ValueError):
        return  # the schema reports the bad value
    if tp > 0 and gpus // tp > 1:
        data["inference"] = {**inference, "parallel": {**parallel, "dp": gpus // tp}}


def _move_prime_rl_keys(data: dict) -> None:
    """prime-rl's top-level keys that prime keeps in one role: ``max_async_level`` (the
    orchestrator's ``async_level``), ``max_model_len`` (the server's), ``tokenizer`` (beside the
    model)."""
    moves = (("max_async_level", "orchestrator", ("async_level",)),
             ("max_model_len", "inference", ("model", "max_model_len")))
    for key, role, path in moves:
        if key in data and isinstance(data.get(role, {}), dict):
            node = data.setdefault(role, {})
            for part in path[:-1]:
                node = node.setdefault(part, {}) if isinstance(node.get(part, {}), dict) else {}
            node.setdefault(path[-1], data.pop(key))
    if isinstance(data.get("tokenizer"), dict) and isinstance(data.get("model", {}), dict):
        data.setdefault("model", {}).setdefault("tokenizer", data.pop("tokenizer"))
    ckpt = data.get("ckpt")
    if isinstance(ckpt, dict) and ckpt.get("resume_step") is not None:
        data.setdefault("resume", True)


def _point_client_at_server(data: dict) -> None:
    """Unless the user says otherwise, the orchestrator talks to the servers this run starts:
    one URL per replica (``inference.parallel.dp``, consecutive ports), with their backend."""
    from prime_core.inference.replicas import local_url

    inference = data.get("inference", {})
    if inference is None or inference is False:
        return
    inference = {} if inference is True else inference
    orchestrator = data.get("orchestrator")
    if orchestrator is None:
        orchestrator = data["orchestrator"] = {}
    if not isinstance(orchestrator, dict) or not isinstance(inference, dict):
        return
    client = orchestrator.setdefault("client", {})
    if not isinstance(client, dict):
        return
    if "base_url" not in client:
        server = inference.get("server", {}) if isinstance(inference.get("server", {}), dict) else {}
        parallel = inference.get("parallel", {}) if isinstance(inference.get("parallel", {}), dict) else {}
        try:
            port, dp = int(server.get("port", 8000)), int(parallel.get("dp", 1))
        except (TypeError, ValueError):
            port, dp = None, None  # the schema reports the bad value
        if port is not None:
            client["base_url"] = [local_url(str(server.get("host", "127.0.0.1")), port + i) for i in range(max(dp, 1))]
    if "backend" not in client and isinstance(inference.get("backend"), str):
        client["backend"] = inference["backend"]
    # The orchestrator presents the key the servers it talks to were given.
    server = inference.get("server", {})
    if isinstance(server, dict) and not {"api_key_var", "api_key_file"} & client.keys():
        client["api_key_var"] = server.get("api_key_var", "VLLM_API_KEY")
        if server.get("api_key_file") is not None:
            client["api_key_file"] = server["api_key_file"]
