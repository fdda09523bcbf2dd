"""prime-plugin-ac: activation checkpointing (full and selective) and activation offloading."""
