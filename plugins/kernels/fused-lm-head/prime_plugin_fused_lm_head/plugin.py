"""Hooks of prime-plugin-fused-lm-head: per-token log-probabilities and entropies computed from
the hidden states a chunk at a time, so the ``[N, V]`` logits never exist.

- ``lm_head:fused_torch``: the PyTorch implementation (``torch_impl``), any device and dtype.
- ``lm_head:fused_triton``: the same chunking with its softmax work in Triton kernels
  (``triton_impl``); CUDA tensors in float32/bfloat16/float16.
- ``lm_head:fused``: what the trainer attaches by default; Triton where it applies (CUDA
  tensors, Triton installed, not float64), PyTorch otherwise, decided per call.

``trainer.model.fused_lm_head_token_chunk_size`` (an int or ``auto``) turns on the
``fused_lm_head`` strategy (``lm_head`` slot of the build order), which attaches the kernel
``trainer.model.kernels.lm_head`` names (``fused`` by default) to a native model.

Importing this module stays cheap: torch and triton are imported when a kernel first runs.
"""

from __future__ import annotations

from prime_core import hookimpl
from prime_core.specs import ConfigSection, Kernel, ParallelStrategy

PRIME_PLUGIN_API = 1


@hookimpl
def prime_config_sections():
    return [
        ConfigSection(name="trainer.model", model="prime_plugin_fused_lm_head.config:FusedLMHeadKeys", merge=True,
                      roots=("rl", "sft")),
        ConfigSection(name="", model="prime_plugin_fused_lm_head.config:SFTChunk", merge=True, roots=("sft",)),
    ]


@hookimpl
def prime_parallel_strategies():
    return [ParallelStrategy(name="fused_lm_head", slot="lm_head", apply="prime_plugin_fused_lm_head.strategy:apply",
                             enabled=lambda config, world: config.fused_lm_head_token_chunk_size not in (
                                 None, "disabled"),
                             reference=True, memory="prime_plugin_fused_lm_head.strategy:memory",
                             description="the chunked LM head: log-probabilities without the [tokens, vocab] logits")]


@hookimpl
def prime_trainer_defaults(model_config, context):
    """Unset ``fused_lm_head_token_chunk_size``: ``auto`` for RL (the trainer role) with the
    native model on a GPU in bf16, where the Triton head is exact, faster than the vanilla
    one and a fraction of its memory; the vanilla head elsewhere."""
    if model_config.fused_lm_head_token_chunk_size is not None or not context.fast or context.role != "trainer":
        return None
    if context.impl != "custom":
        return None
    from prime_core.trainer.defaults import Choice

    return [Choice("fused_lm_head_token_chunk_size", "auto",
                   "RL with the native model on a GPU: log-probabilities without the [tokens, vocab] logits")]


@hookimpl
def prime_kernels():
    reference = "eager logits + log_softmax in float64"
    return [
        Kernel(op="lm_head", name="fused", impl="prime_plugin_fused_lm_head.dispatch:fused_logprobs",
               reference=reference,
               description="chunked LM head, log p(target) and entropy without the [N, V] logits: "
                           "Triton on CUDA, PyTorch elsewhere"),
        Kernel(op="lm_head", name="fused_torch", impl="prime_plugin_fused_lm_head.torch_impl:fused_logprobs",
               reference=reference,
               description="chunked LM head in PyTorch (any device and dtype)"),
        Kernel(op="lm_head", name="fused_triton", impl="prime_plugin_fused_lm_head.triton_impl:fused_logprobs",
               reference=reference, available="prime_plugin_fused_lm_head.triton_impl:unavailable_reason",
               description="chunked LM head with Triton softmax kernels (CUDA)"),
    ]
