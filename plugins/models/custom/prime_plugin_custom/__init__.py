"""prime-plugin-custom: native PyTorch implementations of Qwen3, Llama, Qwen3-MoE and
Qwen2-MoE, written to be parallelised.

Modules: ``plugin`` (hooks), ``build`` (``build(model_config, device=...)``), ``model``
(``CausalLM``), ``layers`` (RMSNorm, rotary, ``Attention`` and the default
``sdpa_attention`` kernel), ``moe`` (``SparseMoE``, ``Experts``, ``LocalDispatcher``,
``grouped_mm``), ``adapter`` (hub <-> model tensor names), ``checkpoint`` (safetensors
loading and saving), ``families`` (what is supported).
"""
