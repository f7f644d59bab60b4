"""The numbers the 8-bit exchange's scales are built from, shared by both of its paths.

The torch reference (:mod:`distamp.kernels.fp8_wire`) and the Triton kernels
(:mod:`distamp.kernels.fp8_exchange`) must compute the same scales bit for bit, so they read the
exponent bounds and the target's bits from one place. Kept apart from both: the reference loads
the kernels lazily (``import distamp`` never imports Triton), and the kernels need nothing else
of the reference, so the dependency runs one way only.
"""

from __future__ import annotations

import math

import torch

__all__ = ["LOG2_MAX", "LOG2_MIN", "target_parts"]

# The scale and its reciprocal stay fp32 normal numbers (2**-126 is the smallest); with it any
# finite fp32 amax fits the 8-bit range on up to 2**7 ranks, and overflows() flags the rest.
LOG2_MIN, LOG2_MAX = -126, 126


def target_parts(target: float) -> tuple[int, int]:
    """``target`` rounded to fp32, as ``(significand, exponent)`` with ``target == sig * 2**exp``
    and ``2**23 <= sig < 2**24``: what the scales are computed from, in both paths."""
    value = torch.tensor(target, dtype=torch.float32).item()  # the fp32 the kernels see
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"target must be a positive finite number, got {target!r}")
    mantissa, exponent = math.frexp(value)
    return int(mantissa * 2**24), exponent - 24
