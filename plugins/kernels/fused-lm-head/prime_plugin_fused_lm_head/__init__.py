"""prime-plugin-fused-lm-head: Chunked LM head: log-probabilities and entropy without materialising the logits.

``plugin`` registers ``lm_head:fused``; ``torch_impl.fused_logprobs`` is its PyTorch
implementation, ``chunking.chunk_size_for`` picks the ``"auto"`` token chunk, and
``reference.reference_logprobs`` is the float64 eager version every implementation is
checked against. Nothing here imports torch at package import.
"""
