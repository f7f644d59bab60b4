"""Public path of :mod:`distamp.precision.fp8_parallel` (``distamp.fp8_parallel.*`` as
documented)."""

from __future__ import annotations

from distamp.precision.fp8_parallel import (
    WeightScales,
    fp8_tp_plan,
    gathers_in_float8,
    is_float8_linear,
)

__all__ = [
    "WeightScales",
    "fp8_tp_plan",
    "gathers_in_float8",
    "is_float8_linear",
]
