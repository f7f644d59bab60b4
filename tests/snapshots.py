"""Equality of nested states (state dicts, optimizer states, a test's snapshot of an engine):
the one check the "nothing was changed" and "resumed bitwise" tests share."""

from __future__ import annotations

from typing import Any

import torch


def same_state(a: Any, b: Any) -> bool:
    """``a`` and ``b`` hold the same structure and the same values: tensors bitwise
    (``torch.equal``), dicts by key, lists and tuples in order, anything else by ``==`` with a
    NaN equal to a NaN (a scale or a loss read before a skip may be one)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(same_state(x, y) for x, y in zip(a, b, strict=True))
        )
    return bool(a == b or (a != a and b != b))
