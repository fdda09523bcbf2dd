"""The ac plugin's terms of the predicted memory (``prime plan``; ``prime_core.memory``)."""

from __future__ import annotations


def checkpointing(est, config) -> None:
    """``full``: a checkpointed block keeps only its input, and recomputes its activations
    while its backward runs. ``selective``: the targets' parts keep only their inputs
    (``BlockProfile.targets``), and are recomputed one at a time."""
    ac = config.ac

    def rule(block) -> None:
        if block.index % ac.freq:
            return
        if ac.mode == "full":
            block.transient = block.gpu + block.profile.backward
            block.gpu = block.profile.input
            return
        recomputed = 0.0
        for target in ac.targets:
            covered, keeps = block.profile.targets.get(target, ((), 0.0))
            removed = sum(block.parts.pop(part, 0.0) for part in covered)
            if removed:
                block.parts[f"{target} (inputs)"] = keeps
                recomputed = max(recomputed, removed)
        block.gpu = sum(block.parts.values())
        block.transient += recomputed

    est.rules.append(rule)


def offloading(est, config) -> None:
    """What the blocks keep goes to host memory and comes back for each block's backward; at
    most ``max_inflight_activations`` copies are on their way at once, each at most the
    largest tensor a block saves (its input under full checkpointing)."""
    inflight = config.ac_offloading.max_inflight_activations

    def rule(block) -> None:
        block.cpu += block.gpu
        block.transient += block.gpu
        block.gpu = 0.0

    est.rules.append(rule)
    full = config.ac is not None and config.ac.mode == "full"
    largest = max(((p.input if full else max(p.parts.values())) for p in est.blocks), default=0.0)
    est.add_buffer("ac_offloading: copies in flight", min(inflight, max(1, len(est.blocks))) * largest * est.tokens,
                   ("backward",))
