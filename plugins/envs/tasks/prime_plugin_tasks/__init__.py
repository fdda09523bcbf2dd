"""prime-plugin-tasks: Built-in procedurally generated RL tasks (no downloads)."""
