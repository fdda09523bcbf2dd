"""Hooks of prime-plugin-fsdp: the ``fsdp`` strategy in the ``data_parallel`` slot of the
trainer's build order (FSDP2 ``fully_shard``), and its keys of ``trainer.model``."""

from __future__ import annotations

from prime_core import hookimpl
from prime_core.specs import ConfigSection, ParallelStrategy

PRIME_PLUGIN_API = 1


def enabled(config, world) -> bool:
    """Required with several processes; one process uses it where it has work there: fp32
    master weights under bf16 compute, CPU offload, or bf16 weights' fused update
    (``one_process``; else it would only copy every weight and gradient once more per step)."""
    from prime_plugin_fsdp.one_process import plain

    return world.size > 1 or config.optimization_dtype != config.dtype or config.fsdp_cpu_offload or plain(config)


@hookimpl
def prime_config_sections():
    return [
        ConfigSection(name="trainer.model", model="prime_plugin_fsdp.config:FSDPConfig", merge=True,
                      roots=("rl", "sft")),
        ConfigSection(name="", model="prime_plugin_fsdp.config:FSDPIslands", merge=True, roots=("rl", "sft")),
    ]


@hookimpl
def prime_parallel_strategies():
    return [ParallelStrategy(
        name="fsdp", slot="data_parallel", apply="prime_plugin_fsdp.strategy:apply", enabled=enabled,
        mesh_dims=("dp_replicate", "dp_shard"), degrees=lambda config: {"dp_replicate": config.dp_replicate},
        memory="prime_plugin_fsdp.memory:memory",
        description="FSDP2 full sharding / HSDP, mixed precision, CPU offload",
    )]
