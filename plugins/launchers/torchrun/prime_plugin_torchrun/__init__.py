"""prime-plugin-torchrun: Starts the trainer under torchrun (N processes, one or many nodes)."""
