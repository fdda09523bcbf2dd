"""Config-time checks of expert parallelism, before any process starts."""

from __future__ import annotations

EXPERT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts")
"""Where Hugging Face configs keep the number of (routed) experts: DeepSeek, Mixtral, Qwen-MoE."""

UNKNOWN = object()


def count_experts(name: str, *, trust_remote_code: bool = False):
    """The model's number of experts, ``None`` for a dense model, ``UNKNOWN`` when its
    ``config.json`` cannot be read here (no network, not cached): the run finds out later."""
    try:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    except Exception:  # unreachable hub id, unknown architecture: not this check's business
        return UNKNOWN
    for section in (hf_config, getattr(hf_config, "text_config", None)):
        for key in EXPERT_KEYS:
            value = getattr(section, key, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def problems(config, root: str) -> list[str]:
    from prime_core.config.shared import model_section

    model, key = model_section(config, root)
    ep = getattr(model, "ep", 1)
    if model is None or ep <= 1:
        return []
    found = []
    if getattr(model, "fsdp_cpu_offload", False):
        found.append(f"{key}.fsdp_cpu_offload: not supported with {key}.ep = {ep} (the experts' FSDP units on "
                     "dp_mod_ep are not offloaded); turn one of them off, or use optim_cpu_offload")
    experts = count_experts(model.name, trust_remote_code=getattr(model, "trust_remote_code", False))
    if experts is UNKNOWN:
        return found
    if experts is None:
        found.append(f"{key}.ep = {ep}: the model '{model.name}' has no experts (its config sets none of "
                     f"{', '.join(EXPERT_KEYS)}); expert parallelism needs a mixture-of-experts model: "
                     f"set {key}.ep = 1")
    elif experts % ep:
        divisors = [d for d in range(2, experts + 1) if experts % d == 0]
        found.append(f"{key}.ep = {ep} does not divide the {experts} experts of '{model.name}'; set {key}.ep to "
                     f"one of {', '.join(map(str, divisors))} (or 1)")
    return found
