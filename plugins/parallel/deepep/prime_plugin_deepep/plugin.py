"""Hooks of prime-plugin-deepep.

DeepEP dispatch/combine kernels as an expert-parallel backend.

Nothing is registered yet: the `deepep` EP backend is not implemented in this version, and a
plugin never claims a capability it does not have.
"""

PRIME_PLUGIN_API = 1
