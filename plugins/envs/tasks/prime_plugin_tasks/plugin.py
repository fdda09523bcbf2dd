"""Hooks of prime-plugin-tasks.

Built-in procedurally generated RL tasks (no downloads).

Nothing is registered yet: the built-in environments (e.g. `reverse_text`, `arithmetic`) is not implemented in this version, and a
plugin never claims a capability it does not have.
"""

PRIME_PLUGIN_API = 1
