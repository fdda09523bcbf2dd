"""prime-plugin-fp8: block-scaled FP8 linear layers for training (DeepGEMM or torch scaled_mm).

``plugin`` registers the ``fp8_linear`` kernels; ``convert.convert(model, backend)`` swaps a
model's block projections for ``linear.FP8Linear``; ``linear.fp8_linear`` is the functional
op; ``quant`` holds the 1×128 / 128×128 quantisers and ``gemm`` the backends. Nothing here
imports torch at package import.
"""
