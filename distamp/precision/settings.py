"""Checks of the precision settings' fields, at construction.

The rules dataclasses (:class:`~distamp.precision.adaptive.AdaptiveRules`,
:class:`~distamp.precision.backward_scales.BackwardScaleRules`,
:class:`~distamp.precision.fp8_select.Float8Settings`) are frozen, and their values are read at
training steps far from where they were given: ``headroom_limit="0.5"`` would fail at the first
report with a ``TypeError`` from a comparison, ``max_exponent=2000`` with an ``OverflowError`` in
``2.0 ** k``. Each ``__post_init__`` therefore checks every field here, through
:class:`Fields`: the kind (``ArgumentTypeError``) and the range (``ValueError``), both naming
the field and echoing the value, and stores numbers as plain Python numbers (numpy scalars and
0-d tensors are taken as torch takes them, see :mod:`distamp.arguments`), so that the rules
compare, hash and pickle like the ones written by hand.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch

from distamp.arguments import (
    INT32_MAX,
    INT64_MAX,
    ArgumentTypeError,
    as_bool,
    as_integer,
    as_real,
)
from distamp.precision.patterns import as_patterns

__all__ = ["EXPONENT_LIMIT", "Fields", "as_number", "number_range", "reduce_dtype_of"]

EXPONENT_LIMIT = 24
"""The largest per-block backward-scale exponent ``k`` (``BackwardScaleRules.max_exponent``).

``2**24`` lifts fp16's smallest subnormal (``2**-24``) to 1, so no fp16 gradient needs more;
``2**k`` and ``2**-k`` stay normal float32 with ample room for the loss scale's own factor in
the unscale pass (``1 / scale * 2**-k``); and a block's parameter gradients, ``scale * 2**k``
times their true value, stay within float32 for any sane loss scale. Beyond it ``2.0 ** k``
overflows (``k >= 1024``) or the factors leave float32 long before."""

_SHOWN = {INT32_MAX: "2**31 - 1", INT64_MAX: "2**63 - 1"}


def _show(bound: float) -> str:
    return _SHOWN.get(bound, repr(bound)) if isinstance(bound, int) else repr(bound)


def number_range(
    low: float, high: float, *, low_open: bool = False, high_open: bool = False
) -> str:
    """``[low, high]`` with open ends as ``(`` / ``)``, large bounds as powers of two."""
    left, right = "(" if low_open else "[", ")" if high_open else "]"
    return f"{left}{_show(low)}, {_show(high)}{right}"


def _kind_ok(value: Any, integer: bool) -> bool:
    """Whether ``value`` is a number of the kind torch takes (the range is checked apart)."""
    if isinstance(value, torch.Tensor):
        allowed = value.ndim == 0 and not value.is_complex() and value.dtype != torch.bool
        return allowed and not (integer and value.is_floating_point())
    kind = numbers.Integral if integer else numbers.Real
    return isinstance(value, kind) and not isinstance(value, bool)


def as_number(
    label: str,
    value: Any,
    *,
    integer: bool,
    low: float,
    high: float,
    low_open: bool = False,
    high_open: bool = False,
    why: str = "",
) -> Any:
    """``value`` as a plain ``int`` (``integer``) or finite ``float`` within the range.

    Raises:
        ArgumentTypeError: not a number of that kind (``bool`` and strings included).
        ValueError: not finite, or outside the range; both name ``label`` and echo the value.
    """
    span = number_range(low, high, low_open=low_open, high_open=high_open)
    what = f"{'a whole number' if integer else 'a number'} in {span}{why}"
    if not _kind_ok(value, integer):
        raise ArgumentTypeError(f"{label}={value!r} ({type(value).__name__}): give {what}")
    try:
        number = as_integer(label, value) if integer else as_real(label, value)
    except ValueError:  # not finite, or an int beyond float64
        raise ValueError(f"{label}={value!r}: give {what}") from None
    below = number <= low if low_open else number < low
    above = number >= high if high_open else number > high
    if below or above:
        raise ValueError(f"{label}={value!r}: give {what}")
    return number


_REDUCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def reduce_dtype_of(label: str, value: Any) -> torch.dtype:
    """A dtype FSDP can reduce gradients in: a floating ``torch.dtype`` of 16 bits or more
    (float8 has no reduction kernels, and its range would overflow the summed gradients).

    Raises:
        ArgumentTypeError: not a ``torch.dtype``.
        ValueError: another dtype.
    """
    if not isinstance(value, torch.dtype):
        raise ArgumentTypeError(
            f"{label}={value!r} ({type(value).__name__}): give a torch.dtype, e.g. torch.float32"
        )
    if value not in _REDUCE_DTYPES:
        raise ValueError(f"{label}={value!r}: give one of {', '.join(map(str, _REDUCE_DTYPES))}")
    return value


class Fields:
    """Checks the fields of one frozen dataclass in its ``__post_init__`` and stores their
    normal form (``object.__setattr__``: the documented way for a frozen dataclass to set its
    own fields while it is built).

    Args:
        owner: the dataclass being built.
        labels: the names errors give a field, where they differ from ``Class.field`` (the
            argument of the constructor that forwards it).
    """

    def __init__(self, owner: Any, labels: dict[str, str] | None = None) -> None:
        self.owner = owner
        self.labels = labels or {}

    def label(self, name: str) -> str:
        return self.labels.get(name, f"{type(self.owner).__name__}.{name}")

    def _set(self, name: str, value: Any) -> Any:
        object.__setattr__(self.owner, name, value)
        return value

    def whole(self, name: str, low: int, high: int, why: str = "") -> int:
        """An integer field in ``[low, high]``."""
        value = getattr(self.owner, name)
        number = as_number(self.label(name), value, integer=True, low=low, high=high, why=why)
        return int(self._set(name, number))

    def real(
        self,
        name: str,
        low: float,
        high: float,
        *,
        low_open: bool = False,
        high_open: bool = False,
        why: str = "",
    ) -> float:
        """A real field in the range (open ends as asked)."""
        value = getattr(self.owner, name)
        number = as_number(
            self.label(name),
            value,
            integer=False,
            low=low,
            high=high,
            low_open=low_open,
            high_open=high_open,
            why=why,
        )
        return float(self._set(name, number))

    def flag(self, name: str) -> bool:
        """A ``bool`` field (strict: see :func:`distamp.arguments.as_bool`)."""
        return bool(self._set(name, as_bool(self.label(name), getattr(self.owner, name))))

    def choice(self, name: str, options: tuple[str, ...]) -> str:
        """A string field that must be one of ``options``."""
        value = getattr(self.owner, name)
        if not isinstance(value, str):
            raise ArgumentTypeError(
                f"{self.label(name)}={value!r} ({type(value).__name__}): give one of {options}"
            )
        if value not in options:
            raise ValueError(f"{self.label(name)}={value!r} is not one of {options}")
        return value

    def patterns(
        self, name: str, example: str, *, optional: bool, empty: bool
    ) -> tuple[str, ...] | None:
        """A sequence of name patterns stored as a tuple (see
        :func:`~distamp.precision.patterns.as_patterns`)."""
        value = getattr(self.owner, name)
        found = as_patterns(self.label(name), value, example, optional=optional, empty=empty)
        return self._set(name, found)  # type: ignore[no-any-return]
