"""Hooks of prime-plugin-torchrun.

Starts the trainer under torchrun (N processes, one or many nodes).

Nothing is registered yet: the `torchrun` launcher (multi-process and multi-node trainer) is not implemented in this version, and a
plugin never claims a capability it does not have.
"""

PRIME_PLUGIN_API = 1
