"""Building the policy from the model-implementation registry, and the forward pass over
packed rows (block-diagonal causal attention rebuilt from ``position_ids``)."""

from __future__ import annotations

from prime_core.errors import PluginError


def hf_config_of(model_config):
    """The checkpoint's Hugging Face config (``trainer.model.name``), with a clear error where it
    cannot be read."""
    from transformers import AutoConfig

    from prime_core.hub import loading

    with loading(model_config.name, "model.name"):
        return AutoConfig.from_pretrained(model_config.name, trust_remote_code=model_config.trust_remote_code)


def resolve_impl(model_config, manager):
    """The ``ModelImpl`` for ``trainer.model.impl``; ``auto`` takes the highest-priority
    implementation that supports the checkpoint's architecture."""
    if model_config.impl != "auto":
        return manager.select("model_impls", model_config.impl, key="trainer.model.impl")
    hf_config = hf_config_of(model_config)
    candidates = [p.spec for p in manager.registry("model_impls").values()
                  if p.spec.unavailable_reason() is None and (p.spec.supports is None or p.spec.supports(hf_config))]
    if not candidates:
        raise PluginError(
            f"trainer.model.impl = 'auto': no installed model implementation supports "
            f"{getattr(hf_config, 'architectures', None) or hf_config.model_type}",
            hint="install a model implementation plugin that supports it (`prime plugins list`)",
        )
    return max(candidates, key=lambda spec: (spec.priority, spec.name))


def block_causal_mask(position_ids):
    """``[B, 1, L, L]`` boolean mask of ``[B, L]`` position ids: causal within each packed
    sample, nothing across."""
    import torch

    starts = (position_ids == 0).long()
    segment = torch.cumsum(starts, dim=-1)  # [1, L]
    same = segment[:, :, None] == segment[:, None, :]
    length = position_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    return (same & causal)[:, None]


def token_logprobs(model, input_ids, position_ids, *, temperature: float = 1.0, with_entropy: bool = True):
    """Log-probability of every token given its prefix (position 0 gets 0) and the
    entropy of each predictive distribution, at ``temperature``. Shapes ``[L]``, float32."""
    import torch

    targets = torch.roll(input_ids[0], -1)
    logp, entropy = predicted_logprobs(model, input_ids, position_ids, targets, temperature=temperature,
                                       with_entropy=with_entropy)
    zero = logp.new_zeros(1)
    return torch.cat([zero, logp[:-1]]), (torch.cat([zero, entropy[:-1]]) if with_entropy else None)


def predicted_logprobs(model, input_ids, position_ids, targets, *, packing=None, temperature: float = 1.0,
                       with_entropy: bool = True):
    """At every input position j: log p(``targets[j]`` | the tokens up to j) and the entropy
    of that prediction, at ``temperature``. Shapes ``[L]``, float32; for ``[B, L]`` ids of
    several rows (models without a ``Packing`` only), ``targets`` and the results are ``[B * L]``.

    Models that take a ``Packing`` (native implementations) get it (derived from the position
    ids when not given: the whole row); others get a block-diagonal mask for a packed row and
    plain causal attention (the fast kernels) for a row holding one sample (a whole row's
    ``packing``, when given, says which without reading the device). The log-softmax
    never exists in full: see ``TokenLogProb``.
    """
    if getattr(model, "lm_head_fn", None) is not None:  # the fused LM head: no logits at all
        out = model(input_ids=input_ids, position_ids=position_ids, packing=packing, targets=targets,
                    temperature=float(temperature), with_entropy=with_entropy)
        return out.logprobs, (out.entropy if with_entropy else None)
    if getattr(model, "accepts_packing", False):
        logits = model(input_ids=input_ids, position_ids=position_ids, packing=packing).logits
    else:
        assert packing is None or packing.contiguous, "a split row needs a model implementation that takes a Packing"
        single = packing.single_sample() if packing is not None else bool((position_ids[:, 1:] != 0).all())
        mask = None if single else block_causal_mask(position_ids)
        logits = model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=False).logits
    logp, entropy = token_logprob_fn()(logits.flatten(0, 1), targets, float(temperature), with_entropy)
    return logp, (entropy if with_entropy else None)


_FN = None
CHUNK_ELEMENTS = 1 << 28
"""Logit elements per chunk (1 GiB in float32)."""


def token_logprob_fn():
    """``TokenLogProb.apply``: ``(logits [N, V], targets [N], temperature, with_entropy) ->
    (log p(target) [N], entropy [N])``, both float32, entropy without gradient.

    It works through the logits a chunk of rows at a time in float32 and saves only the
    logits (in the model's dtype) and one log-sum-exp per row; the backward pass recomputes
    each chunk's softmax. Memory beyond the logits themselves is a few chunks, instead of
    several ``[N, V]`` float32 tensors (tens of GiB for a 150k vocabulary at 32k tokens).
    """
    global _FN
    if _FN is not None:
        return _FN
    import torch

    def rows(logits) -> int:
        return max(1, CHUNK_ELEMENTS // max(1, logits.shape[-1]))

    class TokenLogProb(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, targets, temperature, with_entropy):
            n = logits.shape[0]
            # float32 at least (float64 stays float64: the parity harness's exact reference)
            work = torch.promote_types(logits.dtype, torch.float32)
            logp = torch.empty(n, dtype=work, device=logits.device)
            lse = torch.empty_like(logp)
            entropy = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
            step = rows(logits)
            for start in range(0, n, step):
                end = min(n, start + step)
                x = logits[start:end].to(work)
                if temperature != 1.0:
                    x = x / temperature
                chunk_lse = torch.logsumexp(x, dim=-1)
                lse[start:end] = chunk_lse
                logp[start:end] = x.gather(-1, targets[start:end, None])[:, 0] - chunk_lse
                if with_entropy:
                    entropy[start:end] = chunk_lse - (torch.softmax(x, dim=-1) * x).sum(-1)
            ctx.save_for_backward(logits, targets, lse)
            ctx.temperature = temperature
            ctx.mark_non_differentiable(entropy)
            return logp, entropy

        @staticmethod
        def backward(ctx, grad_logp, _grad_entropy):
            logits, targets, lse = ctx.saved_tensors
            temperature = ctx.temperature
            grad = torch.empty_like(logits)
            step = rows(logits)
            for start in range(0, logits.shape[0], step):
                end = min(logits.shape[0], start + step)
                x = logits[start:end].to(lse.dtype)
                if temperature != 1.0:
                    x = x / temperature
                g = grad_logp[start:end, None].to(lse.dtype)
                # d logp / d x = onehot(target) - softmax(x), times 1/T through the scaling.
                chunk = torch.exp(x - lse[start:end, None]).mul_(-g)
                chunk.scatter_add_(-1, targets[start:end, None], g)
                if temperature != 1.0:
                    chunk.div_(temperature)
                grad[start:end] = chunk
            return grad, None, None, None

    _FN = TokenLogProb.apply
    return _FN


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
