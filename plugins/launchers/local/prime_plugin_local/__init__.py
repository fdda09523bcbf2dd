"""prime-plugin-local: Runs every role on this machine as child processes and stops them together."""
