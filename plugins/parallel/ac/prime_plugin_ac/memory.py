"""The ac plugin's terms of the predicted memory (``prime plan``; ``prime_core.memory``)."""

from __future__ import annotations


def checkpointing(est, config) -> None:
    """``full``: a checkpointed block keeps only its input, and recomputes its activations
    while its backward runs. ``selective``: the targets' parts keep only their inputs
    (``BlockProfile.targets``), and are recomputed one at a time. ``mlp_token_chunk_size``: a
    dense MLP's intermediates and their gradients exist for one chunk of the row at a time,
    beside its output (or its input's gradient) joined from the chunks."""
    ac = config.ac
    chunk = ac.mlp_token_chunk_size

    def rule(block) -> None:
        if block.index % ac.freq:
            return
        covered, keeps = block.profile.targets.get("mlp", ((), 0.0))
        chunked = bool(chunk and covered) and "router" not in block.parts  # MoE layers stay whole
        # Per token of the row: what the MLP holds beyond its input, and one chunk's share of that
        # and of the backward's gradients (the dense block's backward term is the MLP's).
        inner = sum(block.parts.get(part, 0.0) for part in covered) - keeps if chunked else 0.0
        one_chunk = (inner + block.profile.backward) * min(1.0, chunk / est.tokens) + keeps if chunked else 0.0
        if ac.mode == "full":
            block.transient = block.gpu - inner + one_chunk if chunked else block.gpu + block.profile.backward
            block.gpu = block.profile.input
            return
        recomputed = 0.0
        targets = [t for t in ac.targets if not (chunked and t in ("mlp", "mlp_proj"))]
        if chunked:
            for part in covered:
                block.parts.pop(part, None)
            block.parts["mlp (chunk inputs)"] = keeps
            block.transient = one_chunk
        for target in targets:
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
    largest tensor a block saves (its input under full checkpointing). With ``blocks`` set, only
    the first that many blocks offload."""
    inflight, offloaded = config.ac_offloading.max_inflight_activations, config.ac_offloading.blocks

    def rule(block) -> None:
        if offloaded is not None and block.index >= offloaded:
            return
        block.cpu += block.gpu
        block.transient += block.gpu
        block.gpu = 0.0

    est.rules.append(rule)
    full = config.ac is not None and config.ac.mode == "full"
    blocks = est.blocks[:offloaded]
    largest = max(((p.input if full else max(p.parts.values())) for p in blocks), default=0.0)
    est.add_buffer("ac_offloading: copies in flight", min(inflight, max(1, len(blocks))) * largest * est.tokens,
                   ("backward",))
