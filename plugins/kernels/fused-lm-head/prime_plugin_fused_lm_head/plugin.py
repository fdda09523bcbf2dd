"""Hooks of prime-plugin-fused-lm-head.

Chunked LM head: log-probabilities and entropy without materialising the logits.

Nothing is registered yet: the `lm_head:fused` kernel is not implemented in this version, and a
plugin never claims a capability it does not have.
"""

PRIME_PLUGIN_API = 1
