"""Hooks of prime-plugin-fsdp.

FSDP2 sharding (full, HSDP), CPU offload and mixed precision for the trainer.

Nothing is registered yet: the `fsdp` parallel strategy is not implemented in this version, and a
plugin never claims a capability it does not have.
"""

PRIME_PLUGIN_API = 1
