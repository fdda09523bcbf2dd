"""The fsdp strategy's terms of the predicted memory (``prime plan``; ``prime_core.memory``)."""

from __future__ import annotations

REDUCE_BYTES = {"float32": 4, "bfloat16": 2}


def memory(est, config) -> None:
    """Every parameter sharded over the data-parallel ranks (those an earlier strategy split
    over a degree ``D``: over ``dp_mod_D``), and FSDP's own GPU copies:

    - gathered weights in the compute dtype: the root (embeddings, LM head; never resharded)
      and the block being computed plus the one prefetched (every block, from forward to
      backward, with ``reshard_after_forward = false``), and the root's unsharded gradient,
      alive from the LM head's backward to the end of the backward pass;
    - when the last gradients are reduced: the largest unit's gradient in ``reduce_dtype`` and
      its reduced shard;
    - ``fsdp_cpu_offload``: parameters, gradients and optimizer state in host memory.

    In one process without FSDP (``one_process``): a compute copy of every trainable weight,
    frozen weights in the compute dtype alone, and, when the gradients are cast to float32
    before the step, one chunk of them still in the compute dtype beside its cast (until then
    the compute-dtype gradients take less than the float32 ones counted); with bfloat16 weights
    and no master (``one_process.plain``), nothing."""
    from prime_plugin_fsdp import one_process

    if one_process.chosen(config, est.processes):
        if one_process.plain(config):
            return
        dt = est.compute_bytes
        for param in est.params.values():
            if not param.trainable:
                param.shards *= est.master_bytes / dt
        trainable = est.held(trainable=True)
        est.add_buffer("mixed precision: compute copies", trainable * dt)
        est.add_buffer("mixed precision: gradients being cast", min(trainable, one_process.CHUNK_ELEMENTS) * dt,
                       ("gradients",))
        return
    shard = est.processes // max(1, config.dp_replicate)
    for param in est.params.values():
        param.shards *= est.processes // est.degrees.get(param.dim, 1) if param.dim else shard
    dt = est.compute_bytes
    root = sum(p.numel for p in est.params.values() if p.block is None)
    root_trainable = sum(p.numel for p in est.params.values() if p.block is None and p.trainable)
    blocks = est.block_numel()
    largest = max(blocks, default=0)
    gathered = sum(blocks) if not config.reshard_after_forward else min(2, len(blocks)) * largest
    est.add_buffer("fsdp: gathered weights", (root + gathered) * dt, ("backward",))
    est.add_buffer("fsdp: root gradient before its reduce", root_trainable * dt, ("backward",))
    unit = max(root_trainable, largest)
    est.add_buffer("fsdp: gradient reduce buffers", unit * REDUCE_BYTES[config.reduce_dtype] * (1 + 1 / shard),
                   ("gradients",))
    if config.fsdp_cpu_offload:
        est.states.update(parameters="cpu", gradients="cpu", optimizer="cpu")
