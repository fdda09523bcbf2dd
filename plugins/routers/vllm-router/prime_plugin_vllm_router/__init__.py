"""prime-plugin-vllm-router: vllm-router in front of the inference replicas."""
