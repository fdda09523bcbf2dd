"""Hooks of prime-plugin-cp.

Context parallelism (ring and ulysses) for long sequences.

Nothing is registered yet: the `cp` parallel strategy is not implemented in this version, and a
plugin never claims a capability it does not have.
"""

PRIME_PLUGIN_API = 1
