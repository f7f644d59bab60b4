"""Argument and state_dict validation for DistributedGradScaler.

Kept apart from the state machine so that every bad value is rejected up front with a
``ValueError`` naming the field, never later as a crash deep inside torch. "Valid" means more
than "a finite number": each value must fit where it is stored and survive the update rule.

=========================  ====================================  ===============================
field                      accepted                              why
=========================  ====================================  ===============================
``init_scale``/``scale``   normal float32, in [min, max scale]   kept in a float32 tensor
``min_scale``/``max_scale`` None or normal float32, min <= max   compared with that tensor
``growth_factor``          1 < x <= float32 max                  a larger one can never grow
``backoff_factor``         0 < x < 1                             result clamped at the floor
``growth_interval``        integer in [1, 2**31 - 1]             the tracker counting to it is
                                                                 int32
``hysteresis``             integer in [1, 2**31 - 1]             its tracker is int32
``_growth_tracker``        integer in [0, growth_interval - 1]   int32 (torch's dtype), +1 a step;
                                                                 grows the scale on reaching
                                                                 the interval, never past it
``_hysteresis_tracker``    integer in [0, hysteresis]            int32, counts down from and is
                                                                 refilled to ``hysteresis``
``skipped_steps``          integer in [0, 2**63 - 1]             int64
=========================  ====================================  ===============================

"normal float32" is ``torch.finfo(torch.float32).tiny <= x <= torch.finfo(torch.float32).max``
(1.1754944e-38 to 3.4028235e38): a smaller value rounds to a subnormal or to 0 in the scale
tensor, a larger one to inf. Numbers are accepted as torch accepts them: any ``numbers.Real``
(``numbers.Integral`` for the integer fields), numpy scalars and 0-d tensors included, ``bool``
refused; they are stored as plain Python ``float``/``int`` so that ``state_dict()`` loads with
``torch.load(weights_only=True)``. torch's setters (``set_growth_factor``, ``set_backoff_factor``,
``set_growth_interval``) are held to the constructor's ranges (:func:`check_growth_factor` and
the like), and a state_dict's trackers to the settings they count towards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from distamp.arguments import INT32_MAX, INT64_MAX, as_integer, as_real

__all__ = [
    "INT32_MAX",
    "INT64_MAX",
    "SCALE_MAX",
    "SCALE_MIN",
    "as_integer",
    "as_real",
    "check_backoff_factor",
    "check_device",
    "check_growth_factor",
    "check_growth_interval",
    "check_new_scale",
    "check_scaler_args",
    "validate_state_dict",
]

TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
_KNOWN_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "npu", "xla", "privateuseone")

SCALE_MIN = float(torch.finfo(torch.float32).tiny)
"""The smallest normal float32: the scale's floor when no ``min_scale`` is set."""
SCALE_MAX = float(torch.finfo(torch.float32).max)
"""The largest finite float32."""
_SCALE_RANGE = f"a normal float32 in [{SCALE_MIN:.8g}, {SCALE_MAX:.8g}]"


def _in_range(name: str, value: float, low: float, high: float, what: str) -> None:
    if not low <= value <= high:
        raise ValueError(f"`{name}` must be {what}, got {value!r}")


def _scale_value(name: str, value: Any) -> float:
    x = as_real(name, value)
    _in_range(name, x, SCALE_MIN, SCALE_MAX, _SCALE_RANGE)
    return x


def _int_value(name: str, value: Any, low: int, high: int, why: str) -> int:
    n = as_integer(name, value)
    if not low <= n <= high:
        raise ValueError(f"`{name}` must be an int in [{low}, {high}] ({why}), got {n!r}")
    return n


def _plain(key: str) -> str:
    return key


def _in_state(key: str) -> str:
    return f"state_dict['{key}']"


def _growth_in_range(name: str, g: float, given: Any) -> float:
    if not 1.0 < g <= SCALE_MAX:
        raise ValueError(
            f"`{name}` must be > 1 and <= {SCALE_MAX:.8g} (a larger factor overflows float32 "
            f"at every growth), got {given!r}"
        )
    return g


def _backoff_in_range(name: str, b: float, given: Any) -> float:
    if not 0.0 < b < 1.0:
        raise ValueError(f"`{name}` must be in (0, 1), got {given!r}")
    return b


def _factors(growth: Any, backoff: Any, name: Callable[[str], str]) -> tuple[float, float]:
    gname, bname = name("growth_factor"), name("backoff_factor")
    g, b = as_real(gname, growth), as_real(bname, backoff)
    return _growth_in_range(gname, g, growth), _backoff_in_range(bname, b, backoff)


_INTERVAL_WHY = "counted in int32"


def _bounds(low: Any, high: Any, name: Callable[[str], str]) -> tuple[float | None, float | None]:
    lname, hname = name("min_scale"), name("max_scale")
    lo = None if low is None else _scale_value(lname, low)
    hi = None if high is None else _scale_value(hname, high)
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"`{lname}`={low!r} must be <= `{hname}`={high!r}")
    return lo, hi


def _scale_between(
    scale: float, low: float | None, high: float | None, name: Callable[[str], str], key: str
) -> None:
    if low is not None and scale < low:
        raise ValueError(f"`{name(key)}`={scale!r} is below `{name('min_scale')}`={low!r}")
    if high is not None and scale > high:
        raise ValueError(f"`{name(key)}`={scale!r} is above `{name('max_scale')}`={high!r}")


def check_device(device: Any) -> str:
    """Normalise a device argument to a device type string torch knows."""
    if isinstance(device, torch.device):
        device = device.type
    if not isinstance(device, str):
        raise ValueError(f"`device` must be a device type such as 'cuda' or 'cpu', got {device!r}")
    try:
        dev_type = torch.device(device).type
    except RuntimeError as e:
        raise ValueError(f"`device`={device!r} is not a device torch knows: {e}") from None
    if dev_type not in _KNOWN_DEVICE_TYPES:
        raise ValueError(f"`device`={device!r} is not supported; use one of {_KNOWN_DEVICE_TYPES}")
    return dev_type


def check_scaler_args(
    *,
    init_scale: Any,
    growth_factor: Any,
    backoff_factor: Any,
    growth_interval: Any,
    enabled: Any,
    hysteresis: Any,
    min_scale: Any,
    max_scale: Any,
    sync_free: Any,
    check_only: Any = False,
) -> tuple[float, float, float, int]:
    """Validate DistributedGradScaler's constructor arguments (raises ``ValueError``).

    Returns:
        ``(init_scale, growth_factor, backoff_factor, growth_interval)`` as plain Python numbers,
        what torch's base class then stores (see the module doc for the ranges).
    """
    for name, flag in (("enabled", enabled), ("sync_free", sync_free), ("check_only", check_only)):
        if not isinstance(flag, bool):
            raise ValueError(f"`{name}` must be a bool, got {flag!r}")
    scale = _scale_value("init_scale", init_scale)
    growth, backoff = _factors(growth_factor, backoff_factor, _plain)
    interval = _int_value("growth_interval", growth_interval, 1, INT32_MAX, _INTERVAL_WHY)
    _int_value("hysteresis", hysteresis, 1, INT32_MAX, "its tracker is int32")
    low, high = _bounds(min_scale, max_scale, _plain)
    _scale_between(scale, low, high, _plain, "init_scale")
    return scale, growth, backoff, interval


def check_new_scale(
    value: Any, min_scale: float | None, max_scale: float | None
) -> float | torch.Tensor:
    """Check ``update(new_scale=...)``: a normal finite float32 within the scaler's bounds, like
    every other way a scale enters (raises ``ValueError``; torch's scaler takes 0 or inf here and
    then trains on a dead scale). A tensor must hold one element; it is read once to check it (one
    host sync on an accelerator: setting the scale by hand is not a per-step path). Returns a
    tensor as given and any other number as a plain float (torch's base class takes only those)."""
    tensor = value if isinstance(value, torch.Tensor) else None
    if tensor is not None:
        if value.numel() != 1 or value.requires_grad:
            raise ValueError(
                "`new_scale` must be a float or a 1-element tensor with requires_grad=False, "
                f"got a tensor of shape {tuple(value.shape)} (requires_grad={value.requires_grad})"
            )
        value = float(value.detach().reshape(()).item())
    scale = _scale_value("new_scale", value)
    _scale_between(scale, min_scale, max_scale, _plain, "new_scale")
    return scale if tensor is None else tensor


def validate_state_dict(
    state_dict: Any,
    *,
    default_hysteresis: int,
    min_scale: float | None = None,
    max_scale: float | None = None,
) -> dict[str, Any]:
    """Check a scaler state_dict and return it normalised to plain Python numbers, with
    distamp's keys filled in.

    Accepts the state of a DistributedGradScaler or of ``torch.amp.GradScaler`` (which lacks
    distamp's keys: hysteresis, its tracker, the bounds, the skip counter). The ranges are the
    constructor's (module doc); ``scale`` must also lie within the bounds the scaler will have
    after loading (the state's own, else ``min_scale``/``max_scale``).
    """
    if not isinstance(state_dict, dict):
        raise ValueError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    if len(state_dict) == 0:
        raise RuntimeError(
            "The source state dict is empty, possibly because it was saved from a disabled "
            "instance of GradScaler."
        )
    missing = [k for k in TORCH_KEYS if k not in state_dict]
    if missing:
        raise ValueError(
            f"scaler state_dict is missing {missing}; expected the state_dict() of a "
            "DistributedGradScaler or torch.amp.GradScaler"
        )
    sd = dict(state_dict)
    sd.setdefault("hysteresis", default_hysteresis)
    sd.setdefault("_hysteresis_tracker", sd["hysteresis"])
    sd.setdefault("skipped_steps", 0)
    sd.setdefault("min_scale", min_scale)
    sd.setdefault("max_scale", max_scale)
    sd["scale"] = _scale_value(_in_state("scale"), sd["scale"])
    sd["growth_factor"], sd["backoff_factor"] = _factors(
        sd["growth_factor"], sd["backoff_factor"], _in_state
    )
    for name, low, high, why in (
        ("growth_interval", 1, INT32_MAX, _INTERVAL_WHY),
        ("_growth_tracker", 0, INT32_MAX - 1, "int32, incremented at each update"),
        ("hysteresis", 1, INT32_MAX, "its tracker is int32"),
        ("_hysteresis_tracker", 0, INT32_MAX, "int32"),
        ("skipped_steps", 0, INT64_MAX, "int64"),
    ):
        sd[name] = _int_value(_in_state(name), sd[name], low, high, why)
    _trackers_within(sd)
    sd["min_scale"], sd["max_scale"] = _bounds(sd["min_scale"], sd["max_scale"], _in_state)
    _scale_between(sd["scale"], sd["min_scale"], sd["max_scale"], _in_state, "scale")
    return sd


def _trackers_within(sd: dict[str, Any]) -> None:
    """Each tracker against the setting it counts towards, in a state whose fields are each in
    range already.

    The growth tracker counts clean steps since the last growth or backoff, and torch's
    ``_amp_update_scale_`` grows the scale when ``tracker + 1`` *equals* ``growth_interval`` (the
    CPU path in :mod:`distamp.scaler.scale_update` runs that very kernel): a tracker at or past
    the interval never equals it again, so the scale would never grow again (until the int32
    counter wrapped around, 2**31 steps later). The hysteresis tracker counts down from
    ``hysteresis`` and is refilled to it: a larger value would tolerate more overflows than
    configured before backing off.
    """
    tracker, interval = sd["_growth_tracker"], sd["growth_interval"]
    if tracker >= interval:
        raise ValueError(
            f"`{_in_state('_growth_tracker')}`={tracker!r} must be < "
            f"`{_in_state('growth_interval')}`={interval!r}: the scale grows when the tracker "
            "reaches the interval and would never grow again (a consistent state has "
            "0 <= _growth_tracker < growth_interval; set the tracker to 0 to restart the count)"
        )
    left, hysteresis = sd["_hysteresis_tracker"], sd["hysteresis"]
    if left > hysteresis:
        raise ValueError(
            f"`{_in_state('_hysteresis_tracker')}`={left!r} must be <= "
            f"`{_in_state('hysteresis')}`={hysteresis!r}: it counts the overflows still "
            "tolerated and is refilled to `hysteresis` (set it to `hysteresis` to refill it)"
        )


def check_growth_factor(new_factor: Any) -> float:
    """Check ``set_growth_factor(new_factor)`` as the constructor checks ``growth_factor``: a
    factor <= 1 would shrink or freeze the scale on clean steps, one past float32's max would
    overflow at every growth. Returns it as a plain float (``ValueError`` otherwise)."""
    return _growth_in_range("new_factor", as_real("new_factor", new_factor), new_factor)


def check_backoff_factor(new_factor: Any) -> float:
    """Check ``set_backoff_factor(new_factor)`` as the constructor checks ``backoff_factor``: a
    factor >= 1 would keep or grow the scale on overflows (up to inf), one <= 0 would zero it.
    Returns it as a plain float (``ValueError`` otherwise)."""
    return _backoff_in_range("new_factor", as_real("new_factor", new_factor), new_factor)


def check_growth_interval(new_interval: Any) -> int:
    """Check ``set_growth_interval(new_interval)`` as the constructor checks
    ``growth_interval``: an integer in [1, 2**31 - 1] (0 or less would never grow the scale,
    more than int32 holds is never reached by the int32 tracker). Returns a plain int."""
    return _int_value("new_interval", new_interval, 1, INT32_MAX, _INTERVAL_WHY)
