"""prime-plugin-cp: Context parallelism (ring and ulysses) for long sequences."""
