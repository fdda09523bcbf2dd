"""A CPU stand-in for liger-kernel (tests only): the functions prime-plugin-liger calls, with
liger's documented semantics in eager PyTorch, including the ones a caller must work around
(RoPE rotating in place; the fused linear cross-entropy scaling every gradient by the first
upstream value, as releases before linkedin/Liger-Kernel#1298 did with reduction="none").
It tests the plugin's use of liger, not liger's kernels."""
