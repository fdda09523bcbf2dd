"""The ``ep`` strategy: shard the experts of every MoE layer over the EP group and route
tokens through the selected EP backend.

A MoE layer is any module with ``num_experts``, ``experts`` and ``dispatcher`` (the
``SparseMoE`` contract): every parameter of ``layer.experts`` has the expert dimension first
(``[E, ...]``) and becomes a ``DTensor`` sharded on dim 0 over ``mesh["ep"]``; the experts'
forward uses the local shard.

Limit: expert parameters are sharded over the EP group only. Ranks at the same place in
different EP groups (``mesh["dp_mod_ep"]``) hold the same experts in full, so the expert
weights, gradients and optimizer state are replicated over ``dp_mod_ep``, not FSDP-sharded.
"""

from __future__ import annotations

import functools

EP_MESH_DIM = "ep"
REPLICA_MESH_DIM = "dp_mod_ep"


def is_moe_layer(module) -> bool:
    return all(hasattr(module, name) for name in ("num_experts", "experts", "dispatcher"))


def moe_layers(model) -> list:
    return [module for module in model.modules() if is_moe_layer(module)]


def apply(model, *, mesh, config, world):
    """``ParallelStrategy.apply`` of ``ep``; returns an ``Applied`` whose ``before_step``
    reduces the expert gradients."""
    from prime_core.plugins import get_plugin_manager
    from prime_core.specs import Applied

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
    return Applied(model, before_step=functools.partial(sync_expert_grads, mesh=mesh, world_size=world.size))


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


def expert_params(model) -> list:
    """The expert parameters this strategy sharded (DTensors on the 1-D ``ep`` mesh)."""
    from torch.distributed.tensor import DTensor

    found, seen = [], set()
    for layer in moe_layers(model):
        for param in layer.experts.parameters():
            if (isinstance(param, DTensor) and param.device_mesh.mesh_dim_names == (EP_MESH_DIM,)
                    and id(param) not in seen):
                seen.add(id(param))
                found.append(param)
    return found


def sync_expert_grads(model, *, mesh, world_size: int) -> None:
    """``before_step``: sum each expert gradient over the replicas (``dp_mod_ep``), then
    divide it by the world size.

    Why the division: the core scales every rank's loss by ``world_size / total_loss_tokens``
    because FSDP averages the gradients it manages over all ranks. Expert parameters are left
    out of FSDP; after the backward pass each rank's expert gradient already holds the
    contributions of every rank of its EP group (the dispatch's backward brings them back), so
    the sum over ``dp_mod_ep`` covers all ranks, and dividing by ``world_size`` gives what
    FSDP's average gives the dense parameters."""
    import torch
    import torch.distributed as dist

    params = [p for p in expert_params(model) if p.requires_grad]
    if not params:
        return
    with torch.no_grad():
        for param in params:
            if param.grad is None:  # every replica must take part in the reduction
                param.grad = torch.zeros_like(param)
        grads = [param.grad.to_local() for param in params]
        replicas = mesh[REPLICA_MESH_DIM]
        if replicas.size() > 1:
            flat = torch.cat([grad.reshape(-1) for grad in grads])
            dist.all_reduce(flat, group=replicas.get_group())
            flat.div_(world_size)
            for grad, part in zip(grads, flat.split([grad.numel() for grad in grads]), strict=True):
                grad.copy_(part.view_as(grad))
        else:
            for grad in grads:
                grad.div_(world_size)
