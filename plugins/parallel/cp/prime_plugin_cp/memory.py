"""The cp strategy's terms of the predicted memory (``prime plan``; ``prime_core.memory``)."""

from __future__ import annotations


def memory(est, config) -> None:
    """Each rank computes ``1/cp`` of every row (padded to a multiple of ``2 cp``), plus the
    attention's exchange buffers of one layer: ``ring`` holds the incoming keys/values and, in
    the backward pass, their float32 gradient accumulators and the output's float32
    accumulator; ``ulysses`` holds q, k, v and the output re-sharded by heads."""
    cp = config.cp
    est.tokens = -(-est.tokens // (2 * cp)) * 2
    hf = est.model.config
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    q = heads * head_dim
    kv = getattr(hf, "num_key_value_heads", heads) * head_dim
    dt = est.compute_bytes
    if config.cp_style == "ring":
        per_token = 2 * (2 * kv * dt) + 2 * kv * 4 + q * 4 * 2
    else:
        per_token = 2 * (2 * q + 2 * kv) * dt
    est.add_buffer(f"cp ({config.cp_style}): exchange buffers", per_token * est.tokens, ("backward",))
