"""Building the policy from the model-implementation registry, and the forward pass over
packed rows (block-diagonal causal attention rebuilt from ``position_ids``)."""

from __future__ import annotations

from prime_core.errors import PluginError


def resolve_impl(model_config, manager):
    """The ``ModelImpl`` for ``trainer.model.impl``; ``auto`` takes the highest-priority
    implementation that supports the checkpoint's architecture."""
    if model_config.impl != "auto":
        return manager.select("model_impls", model_config.impl, key="trainer.model.impl")
    from transformers import AutoConfig

    from prime_core.hub import loading

    with loading(model_config.name, "model.name"):
        hf_config = AutoConfig.from_pretrained(model_config.name, trust_remote_code=model_config.trust_remote_code)
    candidates = [p.spec for p in manager.registry("model_impls").values()
                  if p.spec.unavailable_reason() is None and (p.spec.supports is None or p.spec.supports(hf_config))]
    if not candidates:
        raise PluginError(
            f"trainer.model.impl = 'auto': no installed model implementation supports "
            f"{getattr(hf_config, 'architectures', None) or hf_config.model_type}",
            hint="install prime-plugin-hf (any transformers causal LM)",
        )
    return max(candidates, key=lambda spec: (spec.priority, spec.name))


def build_model(model_config, manager, *, device: str = "cpu"):
    from prime_core.hub import loading

    impl = resolve_impl(model_config, manager)
    with loading(model_config.name, "model.name"):
        return impl.build(model_config, device=device), impl.name


def block_causal_mask(position_ids):
    """``[1, 1, L, L]`` boolean mask: causal within each packed sample, nothing across."""
    import torch

    starts = (position_ids == 0).long()
    segment = torch.cumsum(starts, dim=-1)  # [1, L]
    same = segment[:, :, None] == segment[:, None, :]
    length = position_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    return (same & causal)[:, None]


def token_logprobs(model, input_ids, position_ids, *, temperature: float = 1.0, with_entropy: bool = True,
                   entropy_chunk: int = 4096):
    """Log-probability of every token given its prefix (position 0 gets 0) and the
    entropy of each predictive distribution, at ``temperature``. Shapes ``[L]``.

    A row holding one sample uses plain causal attention (the fast kernels); a packed row
    gets the block-diagonal mask. Log-probabilities come from a log-sum-exp rather than a
    full log-softmax, and the entropy is computed without gradients in chunks, so at most
    two ``[L, vocab]`` float32 tensors are alive.
    """
    import torch

    single = bool((position_ids[0, 1:] != 0).all())
    mask = None if single else block_causal_mask(position_ids)
    logits = model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                   use_cache=False).logits[0, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[0, 1:]
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets[:, None])[:, 0] - lse
    zero = logp.new_zeros(1)
    logp = torch.cat([zero, logp])
    if not with_entropy:
        return logp, None
    with torch.no_grad():
        parts = []
        for start in range(0, logits.shape[0], entropy_chunk):
            chunk, chunk_lse = logits[start:start + entropy_chunk], lse[start:start + entropy_chunk]
            parts.append(chunk_lse - (torch.softmax(chunk, dim=-1) * chunk).sum(-1))
        entropy = torch.cat([zero, *parts]) if parts else zero
    return logp, entropy


def transformer_blocks(model):
    """The ``nn.ModuleList`` holding the model's repeated blocks (decoder layers), found from
    transformers' ``_no_split_modules`` or, failing that, as the longest ``ModuleList``.
    Strategies wrap or shard its entries in place."""
    import torch.nn as nn

    names = set(getattr(model, "_no_split_modules", None) or ())
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    for candidate in lists:
        if names and all(_inner(child).__class__.__name__ in names for child in candidate):
            return candidate
    if not lists:
        raise ValueError(f"{type(model).__name__} has no ModuleList of blocks to wrap or shard")
    return max(lists, key=len)


def _inner(module):
    # Wrappers (checkpointing, offloading) keep the wrapped block under one of these names.
    for attr in ("_checkpoint_wrapped_module", "_offload_wrapped_module", "_orig_mod"):
        if hasattr(module, attr):
            return _inner(getattr(module, attr))
    return module
