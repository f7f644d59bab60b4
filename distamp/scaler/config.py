"""Argument and state_dict validation for DistributedGradScaler.

Kept apart from the state machine so that every bad value is rejected up front with a
``ValueError`` naming the field, never later as a crash deep inside torch.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["check_device", "check_number", "validate_state_dict"]

TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
_KNOWN_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "npu", "xla", "privateuseone")


def check_number(name: str, value: Any, *, integer: bool = False) -> float:
    """Return ``value`` as a float if it is a finite real (an int when ``integer``), else raise."""
    ok_types = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok_types):
        kind = "an int" if integer else "a number"
        raise ValueError(f"`{name}` must be {kind}, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"`{name}` must be finite, got {value!r}")
    return float(value)


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
) -> None:
    """Validate DistributedGradScaler's constructor arguments (raises ``ValueError``)."""
    for name, flag in (("enabled", enabled), ("sync_free", sync_free), ("check_only", check_only)):
        if not isinstance(flag, bool):
            raise ValueError(f"`{name}` must be a bool, got {flag!r}")
    if check_number("init_scale", init_scale) <= 0:
        raise ValueError(f"`init_scale` must be > 0, got {init_scale!r}")
    if check_number("growth_factor", growth_factor) <= 1.0:
        raise ValueError(f"`growth_factor` must be > 1.0, got {growth_factor!r}")
    if not 0.0 < check_number("backoff_factor", backoff_factor) < 1.0:
        raise ValueError(f"`backoff_factor` must be in (0, 1), got {backoff_factor!r}")
    if check_number("growth_interval", growth_interval, integer=True) < 1:
        raise ValueError(f"`growth_interval` must be >= 1, got {growth_interval!r}")
    if check_number("hysteresis", hysteresis, integer=True) < 1:
        raise ValueError(f"`hysteresis` must be >= 1, got {hysteresis!r}")
    for name, bound in (("min_scale", min_scale), ("max_scale", max_scale)):
        if bound is not None and check_number(name, bound) <= 0:
            raise ValueError(f"`{name}` must be > 0 or None, got {bound!r}")
    if min_scale is not None and max_scale is not None and min_scale > max_scale:
        raise ValueError(f"`min_scale`={min_scale!r} must be <= `max_scale`={max_scale!r}")
    if min_scale is not None and init_scale < min_scale:
        raise ValueError(f"`init_scale`={init_scale!r} is below `min_scale`={min_scale!r}")
    if max_scale is not None and init_scale > max_scale:
        raise ValueError(f"`init_scale`={init_scale!r} is above `max_scale`={max_scale!r}")


def validate_state_dict(state_dict: Any, *, default_hysteresis: int) -> dict[str, Any]:
    """Check a scaler state_dict and return it normalised, with distamp's keys filled in.

    Accepts the state of a DistributedGradScaler or of ``torch.amp.GradScaler`` (which lacks
    distamp's keys: hysteresis, its tracker, the bounds, the skip counter).
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
    rules: tuple[tuple[str, bool, float, str], ...] = (
        # key, integer, lower bound, comparison
        ("scale", False, 0.0, ">"),
        ("growth_factor", False, 1.0, ">"),
        ("growth_interval", True, 1.0, ">="),
        ("_growth_tracker", True, 0.0, ">="),
        ("hysteresis", True, 1.0, ">="),
        ("_hysteresis_tracker", True, 0.0, ">="),
        ("skipped_steps", True, 0.0, ">="),
    )
    for key, integer, low, op in rules:
        value = check_number(f"state_dict['{key}']", sd[key], integer=integer)
        if (value <= low) if op == ">" else (value < low):
            raise ValueError(f"state_dict['{key}'] must be {op} {low:g}, got {sd[key]!r}")
    if not 0 < check_number("state_dict['backoff_factor']", sd["backoff_factor"]) < 1:
        raise ValueError(
            f"state_dict['backoff_factor'] must be in (0, 1), got {sd['backoff_factor']!r}"
        )
    for key in ("min_scale", "max_scale"):
        if sd.get(key) is not None and check_number(f"state_dict['{key}']", sd[key]) <= 0:
            raise ValueError(f"state_dict['{key}'] must be > 0 or None, got {sd[key]!r}")
    return sd
