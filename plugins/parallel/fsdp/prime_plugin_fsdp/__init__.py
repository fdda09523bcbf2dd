"""prime-plugin-fsdp: FSDP2 sharding (full, HSDP), CPU offload and mixed precision for the trainer."""
