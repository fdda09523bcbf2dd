"""Hooks of prime-plugin-liger.

liger-kernel's RMSNorm, SwiGLU, RoPE and fused linear cross-entropy.

Nothing is registered yet: the liger kernels is not implemented in this version, and a
plugin never claims a capability it does not have.
"""

PRIME_PLUGIN_API = 1
