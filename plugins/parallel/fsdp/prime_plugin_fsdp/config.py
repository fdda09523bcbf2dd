"""The fsdp plugin's keys of ``trainer.model`` (prime-rl's names), and the deployment rule
that sets ``dp_replicate`` from ``deployment.nodes_per_fsdp_group``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from prime_core.config.base import Section


class FSDPConfig(Section):
    reduce_dtype: Literal["bfloat16", "float32"] = "float32"
    """Dtype of the gradient reduction across data-parallel ranks."""
    reshard_after_forward: bool = True
    """Free gathered parameters after each block's forward (gather them again for backward)."""
    fsdp_cpu_offload: bool = False
    """Parameters, gradients and optimizer state in (pinned) CPU memory; the optimizer steps on the CPU."""
    dp_replicate: int = Field(default=1, ge=1)
    """HSDP: this many replicas, each sharding the model over ``processes / dp_replicate`` ranks."""

    @model_validator(mode="after")
    def _one_offload(self):
        if self.fsdp_cpu_offload and getattr(self, "optim_cpu_offload", False):
            raise ValueError("fsdp_cpu_offload and optim_cpu_offload are mutually exclusive: fsdp_cpu_offload "
                             "already keeps optimizer state on CPU; set only one")
        return self


class FSDPIslands(Section):
    """``deployment.nodes_per_fsdp_group`` (multi-node RL and SFT): the train nodes form
    ``num_train_nodes / nodes_per_fsdp_group`` FSDP islands (SFT: ``num_nodes / ...``), HSDP
    replicas each sharding the model over its own nodes' GPUs, i.e. ``dp_replicate``."""

    @model_validator(mode="after")
    def _islands(self):
        deployment = self.deployment
        trainer = getattr(self, "trainer", None)
        model, key = (trainer.model, "trainer.model") if trainer is not None else (self.model, "model")
        group = getattr(deployment, "nodes_per_fsdp_group", None)
        if deployment.type != "multi_node" or group is None:
            return self
        nodes_key = "num_train_nodes" if hasattr(deployment, "num_train_nodes") else "num_nodes"
        nodes = getattr(deployment, nodes_key)
        if nodes % group:
            raise ValueError(f"deployment.nodes_per_fsdp_group = {group} does not divide deployment.{nodes_key} = "
                             f"{nodes}: choose a divisor of the train nodes")
        replicas = nodes // group
        if "dp_replicate" in model.model_fields_set and model.dp_replicate not in (1, replicas):
            raise ValueError(f"{key}.dp_replicate = {model.dp_replicate} but deployment.nodes_per_fsdp_group "
                             f"= {group} of {nodes} train nodes means {replicas} replicas: set one of them, not both")
        object.__setattr__(model, "dp_replicate", replicas)
        return self
