"""How much of a float8 layer's input e4m3 flushes to zero: the numeric monitor's fp8 figure.

torchao's tensorwise recipe scales a tensor by ``448 / amax`` before the cast; an element whose
scaled magnitude falls at or below half of e4m3's smallest subnormal rounds to zero, and the
layer computes as if it were 0. Kept apart from :mod:`distamp.observe.numerics` (which calls it
in a forward pre-hook, eagerly at reporting steps or traced into a compiled block) because it is
pure tensor arithmetic with no state of the monitor's.
"""

from __future__ import annotations

import torch

__all__ = ["flushed_fraction"]


def flushed_fraction(x: torch.Tensor, fmax: float, flush: float) -> torch.Tensor:
    """The fraction of ``x``'s nonzero elements that scaling by ``fmax / amax`` puts at or
    below ``flush`` (0-d, fp32, on ``x``'s device; 0 for an all-zero ``x``). No host sync."""
    a = x.detach().abs().float()
    nonzero = a > 0
    lost = (nonzero & (a * (fmax / a.amax()) <= flush)).sum(dtype=torch.float32)
    return torch.nan_to_num(lost / nonzero.sum(dtype=torch.float32).clamp(min=1.0))
