"""prime-plugin-cp: context parallelism (ring and ulysses attention) for packed variable-length rows.

``ring_attention`` and ``ulysses_attention`` are importable from ``prime_plugin_cp.ring`` and
``prime_plugin_cp.ulysses``; this package imports nothing heavy."""
