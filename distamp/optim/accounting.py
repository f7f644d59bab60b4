"""How many bytes a run keeps per parameter: weights, gradients, masters and optimizer states,
counted by storage (STYLE.md's rule: what is allocated, not what the dtypes promise).

One count for the engine's metrics window (``WindowStats.bytes_per_param``, the run report and
the main job's summary) and for the benchmarks: every tensor is reduced to its untyped storage
(a DTensor to its local shard), each storage counted once, and the sum divided by the model's
parameter count (a DTensor counts its global size), so that a sharded run shows what one rank
holds per parameter of the whole model.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from distamp.optim.master import MasterWeightOptimizer
from distamp.optim.store import local_tensor

__all__ = ["bytes_held", "persistent_tensors"]


def persistent_tensors(
    params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer | None
) -> Iterator[torch.Tensor]:
    """Every tensor training keeps between steps: the parameters, their gradients, the
    optimizer's state (any torch optimizer's) and a master-weight optimizer's masters."""
    for p in params:
        yield p
        if p.grad is not None:
            yield p.grad
    if optimizer is None:
        return
    for state in optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))
    if isinstance(optimizer, MasterWeightOptimizer):
        yield from (m.low for m in optimizer.masters.values() if m.low is not None)


def bytes_held(params: Iterable[torch.Tensor], optimizer: Any = None) -> tuple[int, int]:
    """``(bytes, parameters)``: the bytes of the unique storages of
    :func:`persistent_tensors` on this rank, and the model's parameter count. A trainable
    parameter whose gradient is not allocated now (released after the step, as the engine
    does) counts the gradient it receives in every step: its local size in its dtype. No host
    sync: sizes only."""
    params = list(params)
    seen: dict[tuple[Any, int], int] = {}
    for t in persistent_tensors(params, optimizer):
        local = local_tensor(t)
        try:
            storage = local.untyped_storage()
            seen[(storage.device, storage.data_ptr())] = storage.nbytes()
        except (RuntimeError, NotImplementedError):
            # A wrapper subclass (torchao's float8 weights) has no storage of its own: its
            # elements at its dtype's size, counted once per tensor.
            seen[("tensor", id(local))] = local.numel() * local.element_size()
    to_come = sum(
        local_tensor(p).numel() * p.element_size()
        for p in params
        if p.requires_grad and p.grad is None
    )
    return sum(seen.values()) + to_come, sum(p.numel() for p in params)
