"""The ``ep`` strategy: shard the experts of every MoE layer over the EP group and route
tokens through the selected EP backend.

A MoE layer is any module with ``num_experts``, ``experts`` and ``dispatcher`` (the
``SparseMoE`` contract): every parameter of ``layer.experts`` has the expert dimension first
(``[E, ...]``) and becomes a ``DTensor`` sharded on dim 0 over ``mesh["ep"]``; the experts'
forward uses the local shard.

The data-parallel strategy then shards these DTensors once more over ``mesh["dp_mod_ep"]``
(the ranks at the same place in the other EP groups) and reduces their gradients there
(``ParallelStrategy``'s contract in ``prime_core.specs``), so expert weights, gradients and
optimizer state are split over every rank, not replicated across EP groups.
"""

from __future__ import annotations

EP_MESH_DIM = "ep"


def is_moe_layer(module) -> bool:
    return all(hasattr(module, name) for name in ("num_experts", "experts", "dispatcher"))


def moe_layers(model) -> list:
    return [module for module in model.modules() if is_moe_layer(module)]


def apply(model, *, mesh, config, world):
    """``ParallelStrategy.apply`` of ``ep``."""
    from prime_core.plugins import get_plugin_manager

    ep_mesh = mesh[EP_MESH_DIM]
    ep = ep_mesh.size()
    layers = moe_layers(model)
    if not layers:
        raise ValueError(f"trainer.model.ep = {ep}: the model has no MoE layers (modules with num_experts, "
                         "experts and dispatcher); use an MoE model with impl = 'custom', or set ep = 1")
    for layer in layers:
        if layer.num_experts % ep:
            raise ValueError(f"trainer.model.ep = {ep} does not divide the {layer.num_experts} experts of an MoE "
                             f"layer; set trainer.model.ep to a divisor of {layer.num_experts}")
    backend = get_plugin_manager().select("ep_backends", config.ep_comm_backend, key="trainer.model.ep_comm_backend")
    group = ep_mesh.get_group()
    rank = ep_mesh.get_local_rank()
    dispatchers: dict[int, object] = {}
    for layer in layers:
        shard_experts(layer.experts, layer.num_experts, ep_mesh, rank)
        # One dispatcher per expert count: backends may hold large buffers (DeepEP), and a
        # dispatcher keeps no state between calls beyond what its handle carries.
        if layer.num_experts not in dispatchers:
            dispatchers[layer.num_experts] = backend.make(group, num_experts=layer.num_experts, config=config)
        layer.dispatcher = dispatchers[layer.num_experts]
    return model


def shard_experts(experts, num_experts: int, ep_mesh, rank: int) -> None:
    """Replace each ``[E, ...]`` parameter of ``experts`` by this rank's ``[E / ep, ...]`` shard
    as a ``DTensor`` (``Shard(0)`` over ``ep_mesh``). Meta tensors stay meta: the core fills
    them later from rank 0 (``set_model_state_dict(..., broadcast_from_rank0=True)``)."""
    from torch import nn
    from torch.distributed.tensor import DTensor, Shard

    per_rank = num_experts // ep_mesh.size()
    for name, param in list(experts.named_parameters()):
        if isinstance(param, DTensor):
            raise ValueError(f"experts.{name} is already a DTensor: apply the ep strategy once, before the others")
        if param.dim() == 0 or param.shape[0] != num_experts:
            raise ValueError(f"experts.{name} has shape {tuple(param.shape)}: expert parameters must have the "
                             f"{num_experts} experts as their first dimension")
        # A copy, not a view: the full tensor (rank 0's, kept by the core to broadcast) must
        # not stay alive through the shard.
        local = param.detach()[rank * per_rank:(rank + 1) * per_rank].clone()
        sharded = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
        owner, _, leaf = name.rpartition(".")
        setattr(experts.get_submodule(owner) if owner else experts, leaf,
                nn.Parameter(sharded, requires_grad=param.requires_grad))
