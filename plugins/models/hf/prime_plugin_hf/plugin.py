"""Hooks of prime-plugin-hf.

Any Hugging Face transformers causal LM as the policy.

Nothing is registered yet: the `hf` model implementation is not implemented in this version, and a
plugin never claims a capability it does not have.
"""

PRIME_PLUGIN_API = 1
