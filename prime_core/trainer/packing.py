"""Where each token of a packed row sits, and how a row is split across context-parallel ranks.

A packed row holds several samples back to back; ``position_ids`` restart at 0 where a
sample starts. Attention is causal within a sample and blocked across samples. With context
parallelism (``trainer.model.cp`` > 1) each rank of a CP group holds a subset of the row's
tokens, so the attention kernels need, for every token they see, its sample (``segment_ids``)
and its place in the whole row (``index``): a query at index i may attend a key at index j
when both are in the same sample and j <= i. Kernels derive every mask from these two
tensors, so any split of the row is correct; the split only decides the load balance.

The contract for model implementations that support CP (``prime-plugin-custom``): the model
is called as ``model(input_ids=[1, L], position_ids=[1, L], packing=Packing)`` and every
attention module holds its kernel in ``attention_fn(q, k, v, packing, scale) -> out`` with
``q [L, Hq, D]``, ``k, v [L, Hkv, D]`` (tokens first, one row) so that a CP strategy can
wrap it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PACKED_ROWS_OUTSIDE_GRAPHS = (
    "prime: a packed row's attention runs outside the compiled block, whose graph would otherwise hold the "
    "row's sample boundaries and be compiled again for every packing; with trainer.model.compile.fullgraph = true "
    "only rows of one sample can be compiled, so set it to false for packed rows")
"""The reason given to ``torch.compiler.disable`` by the attention kernels' packed-row paths: dynamo
prints it where ``fullgraph`` turns that graph break into an error."""


@dataclass
class Packing:
    segment_ids: Any
    """``[L]`` int64: the sample each token belongs to (non-decreasing along the full row)."""
    index: Any
    """``[L]`` int64: each token's index in the full row."""
    length: int
    """Tokens in the full row."""
    starts: tuple[int, ...] | None = None
    """Where each sample of the full row starts, when the host knows it (``sample_starts`` of a
    row built from host arrays); ``None``: ``segments`` reads it from ``segment_ids``."""
    cache: dict = field(default_factory=dict, repr=False, compare=False)
    """What kernels derive once per packing (sample boundaries, ...), keyed by the kernel. A
    field, not an attribute: FSDP rebuilds dataclass inputs field by field before every
    wrapped block, and anything set outside the fields would be gone there (recomputed, with
    a host sync, in every layer)."""

    @property
    def contiguous(self) -> bool:
        """The tokens are the whole row, in order (no context-parallel split)."""
        return int(self.index.numel()) == self.length

    @classmethod
    def from_position_ids(cls, position_ids) -> Packing:
        """The packing of a whole row (``position_ids`` ``[L]`` or ``[1, L]``, on the device)."""
        import torch

        positions = position_ids.reshape(-1)
        return cls(segment_ids=segment_ids(positions), index=torch.arange(positions.numel(), device=positions.device),
                   length=int(positions.numel()))

    def select(self, local):
        """The packing of the tokens at ``local`` (indices into this packing's tokens)."""
        return Packing(segment_ids=self.segment_ids[local], index=self.index[local], length=self.length,
                       starts=self.starts)

    def segments(self) -> list[tuple[int, int]]:
        """``(start, end)`` of every sample in a contiguous packing. Without ``starts`` they are
        read from the device once (a host sync) and kept in ``cache``: every layer of a forward
        pass sees the same packing."""
        assert self.contiguous, "segments() needs the whole row"
        starts = self.starts or self.cache.get("starts")
        if starts is None:
            ids = self.segment_ids
            starts = self.cache["starts"] = (0, *(ids[1:] != ids[:-1]).nonzero().flatten().add(1).tolist())
        return list(zip(starts, [*starts[1:], self.length], strict=True))

    def single_sample(self) -> bool:
        """Whether a contiguous packing holds one sample (an empty row counts as one), kept in
        ``cache`` as a plain bool. Kernels call it ahead of the compiled blocks (their
        ``prepare``): a block that reads only this bool guards on it alone, where one that read
        ``segments()`` would guard on the row's sample count and be recompiled for each."""
        single = self.cache.get("single_sample")
        if single is None:
            single = self.cache["single_sample"] = len(self.segments()) == 1
        return single


def segment_ids(positions):
    """``[L]`` sample number of every token (a tensor, or a numpy array on the host): a new
    sample starts where the position is 0."""
    starts = positions == 0
    if len(starts):
        starts[0] = True
    return starts.cumsum(0) - 1


def sample_starts(positions) -> tuple[int, ...]:
    """Where each sample of a row starts, from its position ids on the host (``segment_ids``'s
    boundaries)."""
    import numpy as np

    return (0, *(np.flatnonzero(np.asarray(positions)[1:] == 0) + 1).tolist())


def allowed(q_index, q_segment, k_index, k_segment):
    """``[Lq, Lk]`` bool: which keys each query may attend (same sample, not in the future)."""
    return (q_segment[:, None] == k_segment[None, :]) & (k_index[None, :] <= q_index[:, None])


def pad_to(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def cp_indices(length: int, rank: int, size: int, device=None):
    """The tokens of a row of ``length`` (a multiple of ``2 * size``) that CP rank ``rank``
    holds: chunks ``rank`` and ``2 * size - 1 - rank`` of ``2 * size`` equal chunks, so that
    under causal attention every rank has the same amount of work (an early chunk is cheap,
    a late one expensive)."""
    import torch

    if length % (2 * size):
        raise ValueError(f"row length {length} is not a multiple of 2 * cp = {2 * size}")
    chunk = length // (2 * size)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last_start = (2 * size - 1 - rank) * chunk
    second = torch.arange(last_start, last_start + chunk, device=device)
    return torch.cat([first, second])
