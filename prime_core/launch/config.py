"""The ``[deployment]`` block: where roles run. A union picked by ``type``; when ``type`` is
left out it is inferred (any ``*_nodes`` key means ``multi_node``)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field, model_validator

from prime_core.config.base import Noted, Section

_MULTI_NODE_KEYS = {"num_train_nodes", "num_infer_nodes", "num_nodes", "nodes_per_fsdp_group"}
_SINGLE_NODE_KEYS = {"num_train_gpus", "num_infer_gpus", "num_gpus", "inference_gpu_ids", "trainer_gpu_ids"}


def with_deployment_type(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") == "disaggregated":
        raise ValueError("type = 'disaggregated' (prime-rl's prefill/decode disaggregation): prime serves each "
                         "replica whole, without P/D disaggregation; use type = 'single_node' or 'multi_node' "
                         "(num_prefill_*/num_decode_* nodes become inference nodes)")
    if isinstance(value, dict) and "type" not in value:
        # gpus_per_node belongs to both (prime-rl's single-node tables have it too): alone it means nodes.
        multi = _MULTI_NODE_KEYS & value.keys() or ("gpus_per_node" in value and not _SINGLE_NODE_KEYS & value.keys())
        kind = "multi_node" if multi else "single_node"
        value = {"type": kind, **value}
    return value


infer_deployment_type = BeforeValidator(with_deployment_type)


def gpu_ids(value: Any) -> Any:
    """``0``, ``"0,1,2"`` and ``[0, 1]`` all name GPUs (the command line gives the first two)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return [value]
    if isinstance(value, str):
        return [int(v) if v.strip().isdigit() else v for v in value.split(",") if v.strip()]
    if isinstance(value, tuple):
        return list(value)
    return value


GpuIds = Annotated[list[int] | None, BeforeValidator(gpu_ids)]


class SingleNodeDeployment(Section):
    """RL on one machine. GPUs are taken in order from ``CUDA_VISIBLE_DEVICES`` (or every GPU):
    inference first, then the trainer."""

    type: Literal["single_node"] = "single_node"
    num_train_gpus: int = Field(default=1, ge=1)
    num_infer_gpus: int = Field(default=1, ge=0)
    inference_gpu_ids: GpuIds = None
    """Exact GPUs for inference instead of the next ones in order (the older docs'
    ``--inference-gpu-ids``); naming a GPU for two roles shares it (set
    ``inference.gpu_memory_utilization`` to leave room for the trainer)."""
    trainer_gpu_ids: GpuIds = None
    """Exact GPUs for the trainer (``--trainer-gpu-ids``); their count sets ``num_train_gpus``."""
    num_infer_replicas: int | None = Field(default=None, ge=1)
    """Inference replicas (prime-rl's key): sets ``inference.parallel.dp``."""
    num_teacher_gpus: int | None = Field(default=None, ge=0)
    """GPUs of the teacher's server (prime-rl 0.5): the last ones, after the trainer's; set, it
    starts a teacher server (``teacher_inference``). Unset with ``teacher_inference``: its
    ``parallel.tp``."""
    gpus_per_node: int = Field(default=8, ge=1)
    """GPUs of the machine: the roles' GPUs must fit in it."""

    @model_validator(mode="after")
    def _ids_set_counts(self) -> SingleNodeDeployment:
        # The ids decide the counts; a count that disagrees is refused rather than ignored.
        for ids_key, count_key in (("inference_gpu_ids", "num_infer_gpus"), ("trainer_gpu_ids", "num_train_gpus")):
            ids = getattr(self, ids_key)
            if ids is None:
                continue
            if not ids:
                raise ValueError(f"{ids_key} is empty: name at least one GPU, or leave it out")
            if count_key in self.model_fields_set and getattr(self, count_key) != len(ids):
                raise ValueError(f"{count_key} = {getattr(self, count_key)} but {ids_key} names {len(ids)} GPUs: "
                                 f"leave {count_key} out, or make them agree")
            object.__setattr__(self, count_key, len(ids))
        if self.inference_gpu_ids is None and self.trainer_gpu_ids is None:
            total = self.num_train_gpus + self.num_infer_gpus + (self.num_teacher_gpus or 0)
            if "gpus_per_node" in self.model_fields_set and total > self.gpus_per_node:
                teacher = " + num_teacher_gpus" if self.num_teacher_gpus else ""
                raise ValueError(f"num_train_gpus + num_infer_gpus{teacher} = {total} GPUs do not fit in "
                                 f"gpus_per_node = {self.gpus_per_node}")
        return self


class MultiNodeDeployment(Section):
    """RL across machines (through a cluster launcher such as SLURM)."""

    type: Literal["multi_node"] = "multi_node"
    num_train_nodes: int = Field(default=1, ge=1)
    num_infer_nodes: int = Field(default=1, ge=0)
    gpus_per_node: int = Field(default=8, ge=1)
    nodes_per_fsdp_group: int | None = Field(default=None, ge=1)
    """Train nodes per FSDP island; sets ``trainer.model.dp_replicate``."""
    num_teacher_nodes: int | None = Field(default=None, ge=0)
    """prime-rl 0.5's teacher nodes: refused, as prime-rl did (a teacher server you run yourself:
    ``orchestrator.teacher.client.base_url``)."""
    num_infer_replicas: int | None = Field(default=None, ge=1)
    """Inference replicas over all inference nodes (prime-rl's key): each node runs
    ``num_infer_replicas / num_infer_nodes`` of them, which sets ``inference.parallel.dp``."""
    orchestrator_on_inference: Annotated[bool, Noted(
        "prime's cluster launcher places the orchestrator as its plan says (prime run --dry-run shows it)")] = False


class SFTSingleNodeDeployment(Section):
    type: Literal["single_node"] = "single_node"
    num_gpus: int = Field(default=1, ge=1)
    gpus_per_node: int = Field(default=8, ge=1)
    """GPUs of the machine: ``num_gpus`` must fit in it."""

    @model_validator(mode="after")
    def _fits(self) -> SFTSingleNodeDeployment:
        if "gpus_per_node" in self.model_fields_set and self.num_gpus > self.gpus_per_node:
            raise ValueError(f"num_gpus = {self.num_gpus} does not fit in gpus_per_node = {self.gpus_per_node}")
        return self


class SFTMultiNodeDeployment(Section):
    type: Literal["multi_node"] = "multi_node"
    num_nodes: int = Field(default=1, ge=1)
    gpus_per_node: int = Field(default=8, ge=1)
    nodes_per_fsdp_group: int | None = Field(default=None, ge=1)
    """Nodes per FSDP island; sets ``model.dp_replicate``."""


DISAGGREGATED_KEYS = ("num_prefill_nodes", "num_decode_nodes", "num_prefill_replicas", "num_decode_replicas",
                      "prefill_port", "decode_port", "prefill_env_overrides", "decode_env_overrides",
                      "prefill_vllm_overrides", "decode_vllm_overrides")
"""prime-rl's keys of ``type = "disaggregated"``, which ``infer_deployment_type`` refuses."""


class InferenceSingleNodeDeployment(Section):
    prime_rl_keys: ClassVar[tuple[str, ...]] = DISAGGREGATED_KEYS

    type: Literal["single_node"] = "single_node"
    num_gpus: int = Field(default=1, ge=0)
    gpus_per_node: int = Field(default=8, ge=1)
    """GPUs of the machine."""


class InferenceMultiNodeDeployment(Section):
    """One independent server replica per node."""

    type: Literal["multi_node"] = "multi_node"
    num_nodes: int = Field(default=1, ge=1)
    gpus_per_node: int = Field(default=8, ge=1)


Deployment = Annotated[SingleNodeDeployment | MultiNodeDeployment, Field(discriminator="type")]
SFTDeployment = Annotated[SFTSingleNodeDeployment | SFTMultiNodeDeployment, Field(discriminator="type")]
InferenceDeployment = Annotated[
    InferenceSingleNodeDeployment | InferenceMultiNodeDeployment, Field(discriminator="type")
]


def trainer_processes(deployment) -> tuple[int, str]:
    """How many trainer processes a deployment starts (RL or SFT), and the keys that say so."""
    if deployment.type == "single_node":
        key = "num_train_gpus" if hasattr(deployment, "num_train_gpus") else "num_gpus"
        return getattr(deployment, key), f"deployment.{key}"
    key = "num_train_nodes" if hasattr(deployment, "num_train_nodes") else "num_nodes"
    return getattr(deployment, key) * deployment.gpus_per_node, f"deployment.{key} × gpus_per_node"


def declared_degrees(model_config, manager) -> dict[str, int]:
    """The parallel degrees above 1 that the installed strategies read from ``model_config``
    (``ParallelStrategy.degrees``), by mesh dimension."""
    degrees: dict[str, int] = {}
    for provided in manager.registry("parallel_strategies").values():
        spec = provided.spec
        if spec.degrees is not None:
            degrees.update({dim: size for dim, size in spec.degrees(model_config).items() if size > 1})
    return degrees


def degree_problems(config, root: str, manager, *, where: str | None = None) -> list[str]:
    """Parallel degrees that do not divide the trainer processes the deployment starts."""
    from prime_core.config.shared import model_section
    from prime_core.distributed import ParallelDims

    model, prefix = model_section(config, root)
    deployment = getattr(config, "deployment", None)
    if model is None or deployment is None:
        return []
    processes, keys = trainer_processes(deployment)
    dims = ParallelDims(processes, declared_degrees(model, manager))
    return [f"{problem}: change the degree or the number of GPUs"
            for problem in dims.problems(prefix, f"{processes} trainer processes ({where or keys})")]
