"""prime-plugin-liger: liger-kernel's RMSNorm, SwiGLU, RoPE and fused linear cross-entropy."""
