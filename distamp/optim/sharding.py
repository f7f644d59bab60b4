"""Which rank holds the master and the optimizer state of which parameter (``master="sharded"``),
and the gather that hands every rank the updated 16-bit weights.

ZeRO stage 1, as torch's :class:`~torch.distributed.optim.ZeroRedundancyOptimizer` partitions:
whole parameters, assigned greedily to the least-loaded rank in parameter order, so every rank
computes the same assignment without a word exchanged. ZeroRedundancyOptimizer itself steps the
model's own parameters and broadcasts them one by one; here the stepped values are fp32 masters
that only their owner holds, and what travels is the 16-bit weight (half the bytes of an fp32
broadcast), in ONE all-gather per weight dtype per step, its count fixed by the model alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["WeightGather", "assign_owners", "broadcast_bytes_"]


def assign_owners(sizes: Sequence[int], world: int) -> list[int]:
    """The owning rank of each parameter (``sizes``: element counts, in parameter order)."""
    loads = [0] * world
    owners = []
    for size in sizes:
        rank = min(range(world), key=lambda r: (loads[r], r))
        loads[rank] += size
        owners.append(rank)
    return owners


class WeightGather:
    """After a step, every rank's 16-bit weights are its owners' (one all-gather per dtype).

    Args:
        params: every parameter the optimizer holds, in order (local tensors).
        owners: their owning ranks (:func:`assign_owners`).
        group: the data-parallel group the masters are sharded over (``None``: the default).
    """

    def __init__(
        self, params: Sequence[torch.Tensor], owners: Sequence[int], group: Any = None
    ) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        by_dtype: dict[torch.dtype, list[tuple[int, torch.Tensor]]] = {}
        for owner, p in zip(owners, params, strict=True):
            by_dtype.setdefault(p.dtype, []).append((owner, p))
        # Sorted by name: the same order of collectives on every rank.
        self.plan = [by_dtype[d] for d in sorted(by_dtype, key=str)]

    def gather_(self) -> None:
        """Collective: each owner's weights reach every rank, bit for bit (sent as raw bytes:
        uint8, which every backend gathers; gloo has no int16)."""
        rank = dist.get_rank(self.group)
        for entries in self.plan:
            per_rank: list[list[torch.Tensor]] = [[] for _ in range(self.world)]
            for owner, p in entries:
                per_rank[owner].append(p)
            sizes = [sum(t.numel() * t.element_size() for t in ts) for ts in per_rank]
            width = max(max(sizes), 1)
            device = entries[0][1].device
            mine = torch.zeros(width, dtype=torch.uint8, device=device)
            if per_rank[rank]:
                flat = torch.cat([_bytes(t.detach()) for t in per_rank[rank]])
                mine[: flat.numel()].copy_(flat)
            out = [torch.empty_like(mine) for _ in range(self.world)]
            dist.all_gather(out, mine, group=self.group)
            for r, ts in enumerate(per_rank):
                if r == rank:
                    continue
                offset = 0
                for t in ts:
                    n = t.numel() * t.element_size()
                    with torch.no_grad():
                        _bytes(t).copy_(out[r][offset : offset + n])
                    offset += n


def broadcast_bytes_(tensors: Sequence[torch.Tensor], src: int = 0, group: Any = None) -> None:
    """Collective: ``tensors`` (contiguous, of any dtype, in the same order and shapes on every
    rank) become ``src``'s, bit for bit, in one broadcast of their bytes. How the engine makes
    every DDP replica's masters rank 0's, as DDP makes its weights."""
    if not tensors:
        return
    flat = torch.cat([_bytes(t.detach()) for t in tensors])
    dist.broadcast(flat, src=src, group=group)
    offset = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        with torch.no_grad():
            _bytes(t).copy_(flat[offset : offset + n])
        offset += n


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s storage as a flat uint8 view (``t`` contiguous, as parameters are)."""
    return t.view(-1).view(torch.uint8)
