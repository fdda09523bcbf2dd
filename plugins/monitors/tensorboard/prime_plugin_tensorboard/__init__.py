"""prime-plugin-tensorboard: metrics as TensorBoard event files."""
