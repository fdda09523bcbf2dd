"""prime-plugin-wandb: metrics to Weights & Biases."""
