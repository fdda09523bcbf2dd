"""prime-plugin-compile: torch.compile of the transformer blocks."""
