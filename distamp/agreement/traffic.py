"""Bytes each rank sends for gradients: counted by the hooks, computed for torch's own paths.

Why: a compressed gradient exchange is worth its error only for the bytes it saves, so the
engine's metrics report what each rank sent per step (``grad_bytes`` and ``grad_scale_bytes``
in :class:`~distamp.observe.metrics.WindowStats`) for every path, the uncompressed one included,
and a user reads the ratio off two runs' logs.

- distamp's hooks (``comm_hook="fp32"``, ``"fp16"``, ``"bf16"``, ``"fp8"``, ``"fp8-ef"``) count
  the tensors they hand to the collectives (:class:`WireBytes`, host integers: no sync).
- DDP's own all-reduce (no ``comm_hook``), and FSDP2's / HSDP's own reduce-scatter (and HSDP's
  all-reduce across replicas), send the same volume every step, computed once from the gradient
  sizes (:class:`PlainTraffic`): DDP all-reduces every bucket every step in the gradients'
  dtype; FSDP2 reduce-scatters each parameter padded to whole shards, in fp32 (distamp's reduce
  dtype). Other layouts (tensor-parallel dimensions, FSDP1), torchft's own all-reduce across
  replicas (whose quorum changes from step to step; ``comm_hook="fp8"`` there is counted) and
  PowerSGD (whose ranks choose which tensors to compress) report ``None``.

Volumes are the ring/pairwise algorithms' standard ones (:func:`wire_bytes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["PlainTraffic", "Traffic", "WireBytes", "grad_traffic", "wire_bytes"]


def wire_bytes(kind: str, nbytes: int, world: int) -> int:
    """Bytes one rank sends for a collective handed ``nbytes`` (its input), by the standard
    ring/pairwise volumes: all-reduce ``2 (w-1)/w B``, all-to-all and reduce-scatter
    ``(w-1)/w B`` (``B`` the whole input), all-gather of a ``B``-byte part ``(w-1) B``."""
    if world <= 1:
        return 0
    if kind == "all_reduce":
        return 2 * (world - 1) * nbytes // world
    if kind in ("all_to_all", "reduce_scatter"):
        return (world - 1) * nbytes // world
    if kind == "all_gather":
        return (world - 1) * nbytes
    raise ValueError(f"wire_bytes: unknown collective {kind!r}")


class WireBytes:
    """What a rank sent for gradients, payload and scales apart, counted by a hook as it hands
    tensors to the collectives (host integers, no sync)."""

    def __init__(self) -> None:
        self.payload = 0
        self.scales = 0
        self.steps = 0

    def add(self, kind: str, nbytes: int, world: int, *, scales: bool = False) -> None:
        sent = wire_bytes(kind, nbytes, world)
        if scales:
            self.scales += sent
        else:
            self.payload += sent

    def per_step(self) -> dict[str, float]:
        """Bytes sent per step since the start (``steps`` counted by the owner)."""
        n = max(self.steps, 1)
        return {"payload": self.payload / n, "scales": self.scales / n}

    def totals(self, steps: int) -> tuple[int, int]:
        """Payload and scale bytes sent so far (``steps``: unused, the hook counted them)."""
        return self.payload, self.scales


class PlainTraffic:
    """An uncompressed path's bytes: the same every step, computed from the gradient sizes.

    Args:
        per_step: bytes this rank sends per optimizer step.
    """

    def __init__(self, per_step: int) -> None:
        self.per_step = int(per_step)

    def totals(self, steps: int) -> tuple[int, int]:
        """Payload and scale bytes sent in ``steps`` optimizer steps (no scales)."""
        return self.per_step * steps, 0


Traffic = WireBytes | PlainTraffic


def grad_traffic(
    model: torch.nn.Module, strategy: str, hook_state: Any, replicas: bool = False
) -> Traffic | None:
    """Where the engine reads this rank's gradient bytes from (``None``: not known).
    ``replicas``: the model averages across torchft replica groups."""
    sent = getattr(hook_state, "sent", None)
    if isinstance(sent, WireBytes):
        return sent
    if hook_state is not None:  # PowerSGD: its ranks decide what they compress
        return None
    params = [p for p in model.parameters() if p.requires_grad]
    if replicas:  # torchft's own hook: the quorum changes from step to step
        return None
    if strategy == "ddp":
        group = getattr(model, "process_group", None)
        world = torch.distributed.get_world_size(group)
        nbytes = sum(p.numel() * p.element_size() for p in params)
        return PlainTraffic(wire_bytes("all_reduce", nbytes, world))
    if strategy in ("fsdp2", "hsdp"):
        return _sharded_traffic(params)
    return None


def _sharded_traffic(params: Sequence[torch.Tensor]) -> PlainTraffic | None:
    """FSDP2 / HSDP: each parameter's fp32 gradient, dim 0 padded to whole shards, is
    reduce-scattered over its shard dimension, then its shard all-reduced over the replica
    dimension (HSDP). ``None`` when a parameter is sharded any other way (tensor parallel)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    total = 0
    for p in params:
        if not isinstance(p, DTensor):
            return None
        shard = replicas = 1
        for size, placement in zip(p.device_mesh.shape, p.placements, strict=True):
            if isinstance(placement, Shard) and placement.dim == 0 and shard == 1:
                shard = size
            elif isinstance(placement, Replicate):
                replicas *= size
            else:
                return None
        rows = p.shape[0] if p.dim() else 1
        padded = -(-rows // shard) * shard * (p.numel() // max(rows, 1)) * 4  # fp32 bytes
        total += wire_bytes("reduce_scatter", padded, shard)
        total += wire_bytes("all_reduce", padded // shard, replicas)
    return PlainTraffic(total)
