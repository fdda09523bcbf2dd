"""prime-plugin-fused-lm-head: Chunked LM head: log-probabilities and entropy without materialising the logits."""
