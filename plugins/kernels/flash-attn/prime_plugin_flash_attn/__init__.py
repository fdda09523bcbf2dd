"""prime-plugin-flash-attn: flash-attention 2/3 (varlen) as the attention kernel."""
