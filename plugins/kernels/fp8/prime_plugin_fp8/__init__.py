"""prime-plugin-fp8: Block-scaled FP8 linear layers (DeepGEMM or torch._scaled_mm)."""
