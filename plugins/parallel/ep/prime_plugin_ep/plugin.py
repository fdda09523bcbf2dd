"""Hooks of prime-plugin-ep.

Expert parallelism for MoE models, with a torch all-to-all backend.

Nothing is registered yet: the `ep` parallel strategy and the `torch` EP backend is not implemented in this version, and a
plugin never claims a capability it does not have.
"""

PRIME_PLUGIN_API = 1
