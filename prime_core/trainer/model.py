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


def token_logprobs(model, input_ids, position_ids, *, temperature: float = 1.0, with_entropy: bool = True):
    """Log-probability of every token given its prefix (position 0 gets 0) and the
    entropy of each predictive distribution, at ``temperature``. Shapes ``[L]``."""
    import torch

    logits = model(input_ids=input_ids, position_ids=position_ids,
                   attention_mask=block_causal_mask(position_ids)).logits[0].float()
    logits = logits / temperature
    logp_all = torch.log_softmax(logits[:-1], dim=-1)
    targets = input_ids[0, 1:]
    logp = logp_all.gather(-1, targets[:, None])[:, 0]
    zero = logp.new_zeros(1)
    logp = torch.cat([zero, logp])
    if not with_entropy:
        return logp, None
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, torch.cat([zero, entropy.detach()])
