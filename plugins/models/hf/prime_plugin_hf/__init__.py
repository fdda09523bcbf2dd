"""prime-plugin-hf: Any Hugging Face transformers causal LM as the policy."""
