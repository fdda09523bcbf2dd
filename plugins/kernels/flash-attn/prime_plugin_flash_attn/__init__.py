"""prime-plugin-flash-attn: flash-attention 2/3 (varlen) as the attention kernel of native models
(``attention:flash_attention_2``, ``attention:flash_attention_3``); ``varlen.cu_seqlens`` turns a
``Packing`` into flash-attention's sequence boundaries."""
