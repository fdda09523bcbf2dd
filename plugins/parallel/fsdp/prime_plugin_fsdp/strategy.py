"""The ``fsdp`` strategy (FSDP2 ``fully_shard``).

Full sharding over the data-parallel mesh by default; HSDP (replicate × shard) when the core
hands over a 2-D mesh (``trainer.model.dp_replicate`` > 1). Each transformer block is its own
FSDP unit, then the root (embeddings, final norm, LM head). Mixed precision computes in
``trainer.model.dtype`` with master weights in ``optimization_dtype`` and gradients reduced in
``reduce_dtype``; ``fsdp_cpu_offload`` keeps parameters, gradients and optimizer state in
(pinned) CPU memory. Parameters that are already DTensors when FSDP comes (expert-parallel
experts) are left to the strategy that distributed them.
"""

from __future__ import annotations


def apply(model, *, mesh, config, world):
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    from prime_core.specs import Applied
    from prime_core.trainer.model import transformer_blocks

    compute = getattr(torch, config.dtype)
    master = getattr(torch, config.optimization_dtype)
    mixed = MixedPrecisionPolicy(param_dtype=None if compute == master else compute,
                                 reduce_dtype=getattr(torch, config.reduce_dtype))
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if config.fsdp_cpu_offload else OffloadPolicy()
    # Parameters an earlier strategy distributed (EP's experts) belong to it.
    ignored = {p for p in model.parameters() if isinstance(p, DTensor)} or None
    blocks = transformer_blocks(model)
    for index, block in enumerate(blocks):
        # The last block's parameters are needed again right away by the backward pass.
        reshard = config.reshard_after_forward and index < len(blocks) - 1
        fully_shard(block, mesh=mesh, mp_policy=mixed, offload_policy=offload, reshard_after_forward=reshard,
                    ignored_params=ignored)
    # The root (embeddings, LM head) is what the backward pass needs first: keeping it gathered
    # costs nothing, and the backward pass does not depend on finding its output tensors.
    fully_shard(model, mesh=mesh, mp_policy=mixed, offload_policy=offload, reshard_after_forward=False,
                ignored_params=ignored)
    return Applied(model, param_device="cpu" if config.fsdp_cpu_offload else None)
