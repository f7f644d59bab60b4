"""Checks of the adaptive parts' checkpoint state, before any of it is applied.

:class:`~distamp.precision.adaptive.AdaptivePrecision` and
:class:`~distamp.precision.backward_scales.BackwardScales` restore their state from a checkpoint
that may be truncated, hand-edited or from another model. Applied as it comes, such a state
fails half-way (a promotion replayed on a module this model lacks is a ``KeyError`` after the
earlier ones were re-applied), or is taken and fails later (an exponent of 2000 is an
``OverflowError`` at the next backward; a non-zero exponent on a block that shares a weight
scales one gradient twice). The functions here check the whole state against the bound model
and the rules, change nothing, and return it in plain Python types for the owner to apply:
a refused state is a ``ValueError`` (``ArgumentTypeError`` for a wrong kind) that names the
entry, and the object is as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch

from distamp.arguments import INT64_MAX, ArgumentTypeError
from distamp.precision.patterns import unknown_name
from distamp.precision.settings import EXPONENT_LIMIT, as_number

__all__ = ["check_adaptive_state", "check_backward_scale_state"]

_ADAPTIVE_KEYS = ("changes", "history", "hot", "calm", "pinned", "refused")
_PRECISION_CHANGE = ("step", "module", "before", "after", "reason")
_SCALE_KEYS = ("exponents", "changes", "forward_order", "window")
_SCALE_CHANGE = ("step", "block", "before", "after", "reason")
_COUNT_MAX = 2**24  # window counts are float32: whole numbers are exact up to here
_F32_MAX = float(torch.finfo(torch.float32).max)


def _entries(label: str, value: Any, keys: tuple[str, ...]) -> Mapping[str, Any]:
    """A mapping with exactly ``keys`` (a missing key is a truncated state, an unknown one the
    state of something else)."""
    if not isinstance(value, Mapping):
        raise ArgumentTypeError(
            f"{label} must be a dict with keys {list(keys)}, got {type(value).__name__}"
        )
    missing = [k for k in keys if k not in value]
    extra = [k for k in value if k not in keys]
    if missing or extra:
        raise ValueError(
            f"{label} must have exactly the keys {list(keys)}; missing {missing}, unknown {extra}"
        )
    return value


def _items(label: str, value: Any) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise ArgumentTypeError(f"{label} must be a list, got {type(value).__name__}")
    return list(value)


def _text(label: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ArgumentTypeError(f"{label}={value!r} must be a string")
    return value


def _step(label: str, value: Any) -> int:
    return int(as_number(label, value, integer=True, low=0, high=INT64_MAX))


def _counts(label: str, value: Any, name: Callable[[str, Any], str]) -> dict[str, int]:
    """Module -> reports in a row (a streak: a whole number >= 0)."""
    if not isinstance(value, Mapping):
        raise ArgumentTypeError(f"{label} must be a dict, got {type(value).__name__}")
    return {
        name(f"{label} key", key): _step(f"{label}[{key!r}]", count) for key, count in value.items()
    }


def check_adaptive_state(
    state: Any, *, modules: Sequence[str], fp8: Collection[str], low: str
) -> dict[str, Any]:
    """Check an :meth:`AdaptivePrecision.state_dict` against the bound model.

    The change log must replay: every module is one of ``modules``; a float8 layer (in
    ``fp8``) goes fp8 -> bf16 and back, any other module ``low`` -> fp32 and back, promoted
    only when not promoted and demoted only when promoted; a pinned module ends promoted. Counts
    are whole numbers >= 0, history entries module names or ``None``.

    Args:
        state: the saved state.
        modules: the bound model's module names.
        fp8: the names of its float8 layers (precision "fp8").
        low: the low-precision format of its other modules ("fp16" or "bf16").

    Returns:
        The state in plain Python types, ready to apply.

    Raises:
        ArgumentTypeError: an entry of the wrong kind.
        ValueError: naming the entry: a missing or unknown key, a module this model lacks
            (with the closest names), a value out of range, a log that does not replay.
    """
    label = "adaptive state"
    state = _entries(label, state, _ADAPTIVE_KEYS)
    known = set(modules)

    def name(where: str, value: Any) -> str:
        if not isinstance(value, str) or value not in known:
            raise unknown_name(where, value, modules, "module")
        return value

    promoted: set[str] = set()
    changes = []
    for i, entry in enumerate(_items(f"{label} 'changes'", state["changes"])):
        where = f"{label} 'changes'[{i}]"
        entry = _entries(where, entry, _PRECISION_CHANGE)
        module = name(f"{where}['module']", entry["module"])
        step = _step(f"{where}['step']", entry["step"])
        before = _text(f"{where}['before']", entry["before"])
        after = _text(f"{where}['after']", entry["after"])
        up = ("fp8", "bf16") if module in fp8 else (low, "fp32")
        if (before, after) == up and module not in promoted:
            promoted.add(module)
        elif (before, after) == up[::-1] and module in promoted:
            promoted.discard(module)
        else:
            now = "promoted" if module in promoted else "not promoted"
            raise ValueError(
                f"{where}: {module!r} went {before} -> {after} while {now}; in this run it "
                f"goes {up[0]} -> {up[1]} and back, once in turn "
                "(a checkpoint of another precision, or of other float8 layers?)"
            )
        reason = _text(f"{where}['reason']", entry["reason"])
        changes.append(
            {"step": step, "module": module, "before": before, "after": after, "reason": reason}
        )
    history = [
        None if m is None else name(f"{label} 'history'[{i}]", m)
        for i, m in enumerate(_items(f"{label} 'history'", state["history"]))
    ]
    hot = _counts(f"{label} 'hot'", state["hot"], name)
    calm = _counts(f"{label} 'calm'", state["calm"], name)
    pinned = [name(f"{label} 'pinned'", m) for m in _items(f"{label} 'pinned'", state["pinned"])]
    refused = [
        name(f"{label} 'refused'", m) for m in _items(f"{label} 'refused'", state["refused"])
    ]
    loose = [m for m in pinned if m not in promoted]
    if loose:
        raise ValueError(
            f"{label} 'pinned': {loose[0]!r} is pinned (promoted for good) but the change log "
            "leaves it unpromoted"
        )
    return {
        "changes": changes,
        "history": history,
        "hot": hot,
        "calm": calm,
        "pinned": pinned,
        "refused": refused,
    }


def _window(label: str, value: Any, blocks: int) -> list[float] | None:
    """``[over, non-finite, amax]`` per block: counts of steps (whole, float32-exact), flags
    in {0, 1}, amaxes finite in ``[0, float32 max]``."""
    if value is None:
        return None
    items = _items(label, value)
    if len(items) != 3 * blocks:
        raise ValueError(
            f"{label} must hold 3 values per block ({3 * blocks}), got {len(items)}: a window "
            "of another model's blocks?"
        )
    out = []
    for i, item in enumerate(items):
        where = f"{label}[{i}]"
        part = i // blocks
        if part == 0:
            x = as_number(where, item, integer=False, low=0, high=_COUNT_MAX, why=" (steps)")
            if not float(x).is_integer():
                raise ValueError(f"{where}={item!r}: a count of steps is a whole number")
        elif part == 1:
            x = as_number(where, item, integer=False, low=0, high=1, why=" (a flag)")
            if x not in (0.0, 1.0):
                raise ValueError(f"{where}={item!r}: a non-finite flag is 0 or 1")
        else:
            x = as_number(where, item, integer=False, low=0, high=_F32_MAX, why=" (an amax)")
        out.append(float(x))
    return out


def check_backward_scale_state(
    state: Any, *, names: Sequence[str], pinned: Collection[str], max_exponent: int
) -> dict[str, Any]:
    """Check a :meth:`BackwardScales.state_dict` against the bound blocks and the rules.

    Exponents: one per block of this model, none for another, each a whole number in
    ``[0, max_exponent]`` and 0 for a block that shares a parameter (``pinned``). The log's
    blocks are this model's, its exponents in ``[0, 24]``; the forward order holds each
    block's index at most once; the window ``3 * blocks`` numbers (see :func:`_window`).

    Returns:
        ``{"exponents": [int per block, in names order], "changes": [...],
        "forward_order": [...], "window": [...] | None}`` in plain Python types.

    Raises:
        ArgumentTypeError: an entry of the wrong kind.
        ValueError: naming the entry (a block this model lacks with the closest names, a
            value out of range).
    """
    label = "backward-scale state"
    state = _entries(label, state, _SCALE_KEYS)
    saved = state["exponents"]
    if not isinstance(saved, Mapping):
        raise ArgumentTypeError(f"{label} 'exponents' must be a dict, got {type(saved).__name__}")
    for key in saved:
        if key not in names:
            raise unknown_name(f"{label} 'exponents'", key, names, "block")
    missing = [n for n in names if n not in saved]
    if missing:
        raise ValueError(
            f"{label} 'exponents' has no exponent for block {missing[0]!r} of this model; "
            "resume with the same model and BackwardScaleRules.blocks"
        )
    exponents = []
    for n in names:
        why = " (BackwardScaleRules.max_exponent)"
        k = as_number(
            f"{label} 'exponents'[{n!r}]",
            saved[n],
            integer=True,
            low=0,
            high=max_exponent,
            why=why,
        )
        if k and n in pinned:
            raise ValueError(
                f"{label} 'exponents'[{n!r}]={k}: block {n!r} shares a parameter with another "
                "block, so its exponent stays 0 (one gradient cannot carry two factors)"
            )
        exponents.append(int(k))
    changes = []
    for i, entry in enumerate(_items(f"{label} 'changes'", state["changes"])):
        where = f"{label} 'changes'[{i}]"
        entry = _entries(where, entry, _SCALE_CHANGE)
        block = entry["block"]
        if not isinstance(block, str) or block not in names:
            raise unknown_name(f"{where}['block']", block, names, "block")
        sides = {
            side: int(
                as_number(
                    f"{where}[{side!r}]", entry[side], integer=True, low=0, high=EXPONENT_LIMIT
                )
            )
            for side in ("before", "after")
        }
        step = _step(f"{where}['step']", entry["step"])
        reason = _text(f"{where}['reason']", entry["reason"])
        changes.append({"step": step, "block": block, **sides, "reason": reason})
    order = [
        int(as_number(f"{label} 'forward_order'[{i}]", x, integer=True, low=0, high=len(names) - 1))
        for i, x in enumerate(_items(f"{label} 'forward_order'", state["forward_order"]))
    ]
    if len(set(order)) != len(order):
        raise ValueError(f"{label} 'forward_order'={order!r} holds a block more than once")
    return {
        "exponents": exponents,
        "changes": changes,
        "forward_order": order,
        "window": _window(f"{label} 'window'", state["window"], len(names)),
    }
