"""The stochastic rounding's random numbers: torch's own stream, drawn where it is cheapest.

A rounding draws one number in ``[0, 65536)`` per element from a generator seeded per chunk
(:meth:`~distamp.optim.master.MasterWeightOptimizer._generator`): on the CPU, torch's
``randint`` takes one 32-bit output of its Mersenne Twister (mt19937, seeded with the low 32
bits of the seed) per element and keeps its low 16 bits. numpy's legacy ``RandomState`` is the
same mt19937 with the same seeding, and its ``randint(0, 65536, dtype=int32)`` keeps the same
low 16 bits of the same outputs: the same numbers, about 2.4 times faster (torch draws them one
at a time through its generic serial loop). :class:`Draws` uses it where a first-use check finds
the two streams equal, and torch's generator everywhere else (other devices, no numpy, a
mismatch), so resumed runs and every rank draw what they always drew.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["Draws"]

_RANGE = 1 << 16


class Draws:
    """One chunk's stream of 16-bit random numbers: what ``torch.randint(0, 65536, ...,
    dtype=torch.int32, generator=generator)`` calls after ``generator.manual_seed(seed)``
    draw, call after call."""

    def __init__(self, generator: torch.Generator, seed: int) -> None:
        self.generator = generator.manual_seed(seed)
        self._numpy: Any = None
        if generator.device.type == "cpu" and _numpy_is_torch():
            import numpy as np

            self._numpy = np.random.RandomState(seed & 0xFFFFFFFF)

    def int16_range(self, shape: torch.Size, work: torch.Tensor | None = None) -> torch.Tensor:
        """The next ``shape.numel()`` numbers as an int32 tensor of ``shape``: numpy's array
        itself, or ``work`` (a 4-byte buffer of that size, read as int32; ``None``: a new one)
        filled from torch's generator."""
        if self._numpy is not None:
            import numpy as np

            drawn = self._numpy.randint(0, _RANGE, shape.numel(), dtype=np.int32)
            return torch.from_numpy(drawn).view(shape)
        device = self.generator.device
        into = (
            torch.empty(shape, dtype=torch.int32, device=device)
            if work is None
            else work.view(torch.int32).view(shape)
        )
        # One 32-bit draw per element, in order: the stream torch.randint draws.
        return into.random_(0, _RANGE, generator=self.generator)


@functools.cache
def _numpy_is_torch() -> bool:
    """Whether numpy's legacy mt19937 draws torch's CPU numbers here (checked once per
    process, on seeds below and above 32 bits and across two calls)."""
    try:
        import numpy as np
    except ImportError:
        return False
    gen = torch.Generator()
    for seed in (0, 12_345, (1 << 62) - 3):
        gen.manual_seed(seed)
        state = np.random.RandomState(seed & 0xFFFFFFFF)
        for n in (1_000, 3_001):
            ours = torch.randint(0, _RANGE, (n,), dtype=torch.int32, generator=gen)
            theirs = state.randint(0, _RANGE, n, dtype=np.int32)
            if not torch.equal(ours, torch.from_numpy(theirs)):
                return False
    return True
