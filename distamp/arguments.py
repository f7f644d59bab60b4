"""Numbers as torch accepts them, for every argument distamp checks.

torch's own APIs take any ``numbers.Real`` (``numbers.Integral`` where an integer is meant):
numpy scalars and 0-d tensors included. distamp's checks accept the same, so that code which
computes its settings with numpy keeps working when it swaps torch's scaler for distamp's, and
store plain Python numbers, so that every ``state_dict()`` loads with
``torch.load(weights_only=True)``. ``bool`` is refused: ``True`` is an ``int`` to Python, never
a meaningful scale or interval.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

__all__ = [
    "INT32_MAX",
    "INT64_MAX",
    "ArgumentTypeError",
    "as_bool",
    "as_integer",
    "as_real",
    "integer_or_none",
]

INT32_MAX = 2**31 - 1
"""The largest value an int32 counter (torch's growth tracker, process counts) can hold."""
INT64_MAX = 2**63 - 1
"""The largest value an int64 counter can hold."""


def _scalar(name: str, value: Any, integer: bool) -> Any:
    """A 0-d tensor's Python value (host sync for a device tensor, at construction only)."""
    if not isinstance(value, torch.Tensor):
        return value
    allowed = not value.is_complex() and value.dtype != torch.bool
    if integer:
        allowed = allowed and not value.is_floating_point()
    if value.ndim != 0 or not allowed:
        kind = "an integer" if integer else "a real number"
        raise ValueError(
            f"`{name}` must be {kind}; a tensor is accepted only 0-d with a "
            f"{'integer' if integer else 'real'} dtype, got shape {tuple(value.shape)} "
            f"{value.dtype}"
        )
    return value.item()


def as_real(name: str, value: Any) -> float:
    """``value`` as a finite Python float: any ``numbers.Real`` (numpy scalars too) or a 0-d real
    tensor, not a bool. ``ValueError`` naming ``name`` otherwise."""
    value = _scalar(name, value, integer=False)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"`{name}` must be a real number, got {value!r} ({type(value).__name__})")
    try:
        result = float(value)
    except OverflowError:  # an int beyond float64
        raise ValueError(f"`{name}` must be finite, got {value!r}") from None
    if not math.isfinite(result):
        raise ValueError(f"`{name}` must be finite, got {value!r}")
    return result


def as_integer(name: str, value: Any) -> int:
    """``value`` as a Python int: any ``numbers.Integral`` (numpy integers too) or a 0-d integer
    tensor, not a bool and not a float (torch's integer arguments refuse floats as well)."""
    value = _scalar(name, value, integer=True)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"`{name}` must be an int, got {value!r} ({type(value).__name__})")
    return int(value)


def integer_or_none(value: Any) -> int | None:
    """``value`` as a plain int when it is an integer as torch takes one (any
    ``numbers.Integral`` such as ``numpy.int64``, or a 0-d integer tensor), never a bool; else
    ``None`` (for arguments that also take other kinds of value, such as a precision name)."""
    try:
        return as_integer("value", value)
    except ValueError:
        return None


class ArgumentTypeError(TypeError, ValueError):
    """A value of the wrong kind for its argument (a string where a sequence of patterns is
    expected, ``"no"`` for a flag). A ``TypeError``, as Python and torch raise for a wrong kind;
    a ``ValueError`` too, because distamp refused such values with ``ValueError`` before, and
    callers that catch that must keep working."""


def as_bool(name: str, value: Any) -> bool:
    """``value`` if it is a ``bool``; ``ArgumentTypeError`` naming ``name`` otherwise.

    Strict, as ``torch.autocast(enabled=...)`` is (it refuses ``numpy.bool_``, 0-d tensors and
    ints): a flag given ``"no"`` or ``0`` would otherwise be read by its truth value, and
    ``"no"`` is true."""
    if not isinstance(value, bool):
        kind = type(value)
        where = "" if kind.__module__ == "builtins" else f"{kind.__module__}."
        raise ArgumentTypeError(
            f"`{name}` must be True or False, got {value!r} ({where}{kind.__qualname__}); "
            "pass bool(...) if it is a numpy or tensor flag"
        )
    return value
