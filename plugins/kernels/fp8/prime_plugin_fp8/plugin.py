"""Hooks of prime-plugin-fp8.

Block-scaled FP8 linear layers (DeepGEMM or torch._scaled_mm).

Nothing is registered yet: the `fp8_linear` kernels is not implemented in this version, and a
plugin never claims a capability it does not have.
"""

PRIME_PLUGIN_API = 1
