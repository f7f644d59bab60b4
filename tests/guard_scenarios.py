"""What the plug-ins' step-guard tests share (tests/test_accelerate.py, test_lightning.py,
test_lightning_trainer.py, test_transformers.py): a tiny model, each rank's batches, the spike
(rank 1's loss times 1e3 at :data:`SPIKE_AT`), the overflow injected on rank 1 at every step
(one +inf gradient element, as a rank-local overflow arrives), and the checks made on each rank.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist

from distamp import SpikeGuard

__all__ = [
    "FEATURES",
    "GUARD",
    "INIT_SCALE",
    "LIMIT",
    "SPIKE_AT",
    "STEPS",
    "batch",
    "digest",
    "inject_inf",
    "loss_of",
    "model",
    "same_on_every_rank",
    "snapshot",
    "unchanged",
]

STEPS, SPIKE_AT, FEATURES = 12, 9, 8
GUARD = SpikeGuard(window=8, sigmas=6.0, min_history=4)
LIMIT = 3  # max_consecutive_skips of the limit scenario
INIT_SCALE = 2.0**8  # the spiked loss x1e3 still fits fp16 gradients: a spike, not an overflow


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
    )


def batch(rank: int, step: int, size: int = 4) -> torch.Tensor:
    return torch.randn(size, FEATURES, generator=torch.Generator().manual_seed(100 * step + rank))


def loss_of(module: Any, x: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    """The step's loss; rank 1's is 1e3 times larger at :data:`SPIKE_AT` (a bad batch)."""
    loss = module(x).float().pow(2).mean()
    return loss * 1e3 if rank == 1 and step == SPIKE_AT else loss


def inject_inf(module: torch.nn.Module, rank: int) -> None:
    """One +inf element in rank 1's first gradient (after backward, before the step)."""
    if rank == 1:
        grad = next(iter(module.parameters())).grad
        assert grad is not None
        grad.view(-1)[0] = float("inf")


def snapshot(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def unchanged(before: list[torch.Tensor], module: torch.nn.Module) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))


def digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()


def same_on_every_rank(value: Any) -> None:
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, value)
    assert all(v == seen[0] for v in seen), seen
