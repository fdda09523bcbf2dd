"""The ep strategy's terms of the predicted memory (``prime plan``; ``prime_core.memory``)."""

from __future__ import annotations


def memory(est, config) -> None:
    """The experts of every MoE layer split over ``ep`` ranks (data parallelism then splits
    them over ``dp_mod_ep``), and the token exchange's buffers: the routed copies this rank
    receives and sends back (``tokens × top_k`` rows each way, as many as it sends when the
    routing is even; an uneven routing receives more)."""
    from prime_plugin_ep.strategy import moe_layers

    layers = moe_layers(est.model)
    experts = {id(p) for layer in layers for p in layer.experts.parameters()}
    for name, param in est.model.named_parameters():
        if id(param) in experts and name in est.params:
            est.params[name].shards *= config.ep
            est.params[name].dim = "ep"
    top_k = max((getattr(layer, "top_k", 1) for layer in layers), default=1)
    est.add_buffer("ep: all-to-all buffers", 2 * est.tokens * top_k * est.hidden * est.compute_bytes, ("backward",))
