"""prime-plugin-liger: liger-kernel's RMSNorm, SwiGLU, RoPE (``ops``) and fused linear
cross-entropy as per-token log-probabilities (``lm_head``), plus liger's patching of Hugging Face
models (``hf.apply_to_hf``)."""
