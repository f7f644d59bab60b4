"""Casting a call's arguments up to fp32: what an fp32 island (a static one of the policy, or
one the adaptive rules promoted) does to the low-precision tensors that enter it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["LOW_PRECISION", "to_fp32"]

LOW_PRECISION = (torch.float16, torch.bfloat16)
"""The 16-bit floating dtypes autocast produces."""


def to_fp32(value: Any) -> Any:
    """``value`` with every low-precision floating tensor in it (nested in lists, tuples and
    dicts) cast to fp32; everything else untouched."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in LOW_PRECISION else value
    if isinstance(value, (list, tuple)):
        return type(value)(to_fp32(v) for v in value)
    if isinstance(value, Mapping):
        return {k: to_fp32(v) for k, v in value.items()}
    return value
