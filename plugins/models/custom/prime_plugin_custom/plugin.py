"""Hooks of prime-plugin-custom.

Native dense (Qwen3/Llama) and MoE (Qwen3-MoE) implementations built to be parallelised.

Nothing is registered yet: the `custom` model implementation is not implemented in this version, and a
plugin never claims a capability it does not have.
"""

PRIME_PLUGIN_API = 1
