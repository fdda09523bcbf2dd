"""prime-plugin-custom: Native dense (Qwen3/Llama) and MoE (Qwen3-MoE) implementations built to be parallelised."""
