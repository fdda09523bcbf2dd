"""Hooks of prime-plugin-flash-attn.

flash-attention 2/3 (varlen) as the attention kernel.

Nothing is registered yet: the `attention:flash_attention_*` kernels is not implemented in this version, and a
plugin never claims a capability it does not have.
"""

PRIME_PLUGIN_API = 1
