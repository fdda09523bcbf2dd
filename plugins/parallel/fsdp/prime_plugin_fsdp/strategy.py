"""The ``fsdp`` strategy (FSDP2 ``fully_shard``).

Full sharding over the data-parallel mesh by default; HSDP (replicate × shard) when the core
hands over a 2-D mesh (``trainer.model.dp_replicate`` > 1). Each transformer block is its own
FSDP unit, then the root (embeddings, final norm, LM head). Mixed precision computes in
``trainer.model.dtype`` with master weights in ``optimization_dtype`` and gradients reduced in
``reduce_dtype``; ``fsdp_cpu_offload`` keeps parameters, gradients and optimizer state in
(pinned) CPU memory.

Parameters an earlier strategy sharded over the mesh of a degree ``D`` (expert parallelism's
experts, DTensors on the ``ep`` mesh) are sharded once more over ``dp_mod_D``, the
data-parallel ranks outside that group (torchtitan's "dp_mod_ep" sharding): each module that
holds them becomes its own FSDP unit on that mesh, inside its block's unit. Their weights,
gradients and optimizer state are then split over every rank instead of being replicated over
``dp_mod_D``.

In one process, mixed precision runs without FSDP where it can (``one_process``): FSDP's
collectives would only copy every weight and gradient once more.
"""

from __future__ import annotations


def apply(model, *, mesh, config, world):
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    from prime_core.specs import Applied
    from prime_core.trainer.model import transformer_blocks
    from prime_plugin_fsdp import one_process

    if one_process.usable(model, config=config, world=world):
        return one_process.apply(model, config=config, world=world)
    compute = getattr(torch, config.dtype)
    master = getattr(torch, config.optimization_dtype)
    mixed = MixedPrecisionPolicy(param_dtype=None if compute == master else compute,
                                 reduce_dtype=getattr(torch, config.reduce_dtype))
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if config.fsdp_cpu_offload else OffloadPolicy()
    units = sharded_units(model, world)
    blocks = transformer_blocks(model)
    for index, block in enumerate(blocks):
        # The last block's parameters are needed again right away by the backward pass.
        reshard = config.reshard_after_forward and index < len(blocks) - 1
        inner = [unit for unit in units if _inside(unit.module, block)]
        for unit in inner:
            shard_unit(unit, mixed=mixed, offload=offload, reshard=reshard, world=world)
        fully_shard(block, mesh=mesh, mp_policy=mixed, offload_policy=offload, reshard_after_forward=reshard)
        if inner:
            # Gathered while attention and routing run, not when the experts' hook fires
            # after the dispatch's host sync.
            block.set_modules_to_forward_prefetch([unit.module for unit in inner])
    for unit in units:
        if not _is_fsdp(unit.module):
            shard_unit(unit, mixed=mixed, offload=offload, reshard=False, world=world)
    # The root (embeddings, LM head) is what the backward pass needs first: keeping it gathered
    # costs nothing, and the backward pass does not depend on finding its output tensors.
    fully_shard(model, mesh=mesh, mp_policy=mixed, offload_policy=offload, reshard_after_forward=False)
    return Applied(model, param_device="cpu" if config.fsdp_cpu_offload else None)


class Unit:
    """A module whose own parameters an earlier strategy sharded over the mesh of degree ``dim``."""

    def __init__(self, module, dim: str, params: list) -> None:
        self.module, self.dim, self.params = module, dim, params


def sharded_units(model, world) -> list[Unit]:
    """The modules holding DTensor parameters (an earlier strategy's), each with the degree
    whose mesh they are sharded over; every such parameter must be on the 1-D mesh of a degree
    the core built (``ParallelDims``)."""
    from torch.distributed.tensor import DTensor

    units = []
    degrees = world.dims.degrees if world.dims is not None else {}
    for name, module in model.named_modules():
        params = [(key, p) for key, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)]
        if not params:
            continue
        dims = {p.device_mesh.mesh_dim_names for _, p in params}
        if len(dims) != 1 or len(next(iter(dims)) or ()) != 1 or next(iter(dims))[0] not in degrees:
            raise ValueError(f"{name or 'the model'} holds parameters sharded over the meshes {sorted(map(str, dims))}"
                             f"; the fsdp strategy shards only those on the 1-D mesh of one parallel degree "
                             f"({', '.join(degrees) or 'none declared'}), over its dp_mod_ mesh")
        units.append(Unit(module, next(iter(dims))[0], [p for _, p in params]))
    return units


def shard_unit(unit: Unit, *, mixed, offload, reshard: bool, world) -> None:
    """FSDP over ``dp_mod_<dim>``; gradients divided by the world size like every other one.

    Why the world size: the core scales each rank's loss by ``world_size / loss tokens`` for
    FSDP's average over all ranks. A parameter sharded over ``D`` has, after the backward
    pass, the contributions of its whole ``D`` group in its gradient (EP's dispatch brings
    them back), so the sum over ``dp_mod_D`` covers every rank once."""
    from torch.distributed.fsdp import fully_shard

    outside = world.dims.mesh((f"dp_mod_{unit.dim}",))
    fully_shard(unit.module, mesh=outside, mp_policy=mixed, offload_policy=offload, reshard_after_forward=reshard,
                shard_placement_fn=placement_fn(unit, outside.size()))
    unit.module.set_gradient_divide_factor(float(world.size))
    if world.device.type == "cpu" and outside.size() > 1:
        # gloo has no PREMUL_SUM: sum, then divide. (Not on one rank: FSDP divides in its
        # copy there and would divide a second time.)
        unit.module.set_force_sum_reduction_for_comms(True)


def placement_fn(unit: Unit, ranks: int):
    """Shard each parameter's local part on dim 0 where its rows split evenly over ``ranks``
    (no padding, one contiguous all-gather), else on dim 1 (torchtitan's choice when
    ``dp_mod_ep × ep`` exceeds the experts)."""
    from torch.distributed.tensor import Shard

    def choose(param):
        local = param.to_local().shape if hasattr(param, "to_local") else param.shape
        return Shard(0) if local[0] % ranks == 0 or len(local) < 2 else Shard(1)

    return choose


def _inside(module, block) -> bool:
    return any(module is sub for sub in block.modules())


def _is_fsdp(module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)
