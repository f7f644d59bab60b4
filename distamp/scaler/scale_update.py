"""The loss-scale state update, on device: growth, backoff, hysteresis and bounds.

A pure function of tensors so that it never syncs the host and can be captured in a CUDA graph.
With ``hysteresis=1`` and no bounds it reproduces ``torch._amp_update_scale_`` exactly for every
scale torch keeps normal; where torch's would leave the float32 range, this one stops:

- a backoff never takes the scale below its floor, ``min_scale`` or else the smallest normal
  float32 (``torch.finfo(torch.float32).tiny``): the result is *clamped*, so a tiny
  ``backoff_factor`` or a long run of overflows cannot make the scale subnormal or 0 (torch's
  becomes 0 and the weights NaN). An overflow that arrives while the scale already sits at the
  floor is reported (the returned flag), and the scaler raises ``ScaleUnderflowError``;
- a growth that would overflow float32 leaves the scale where it is (torch's rule), and a
  ``max_scale`` clamps growth below it.

This is the only scale update of the package: the sync-free path runs the same ``update()``, and
the fused kernels (:mod:`distamp.kernels`) only unscale and check, they never update the scale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from distamp.arguments import as_integer, as_real
from distamp.scaler.config import SCALE_MIN
from distamp.torch_compat import amp_update_scale_

__all__ = ["RuleCache", "ScaleRule", "update_scale_"]


@dataclass(frozen=True)
class ScaleRule:
    """The constants of the update.

    Hysteresis follows Megatron-LM: each overflow decrements the tracker and the scale backs off
    once it reaches zero (and on every overflow after that); only a growth refills it. DeepSpeed's
    default ("consecutive_hysteresis=False") refills at the same point.
    """

    growth_factor: float
    backoff_factor: float
    growth_interval: int
    hysteresis: int
    min_scale: float | None
    max_scale: float | None

    def __post_init__(self) -> None:
        # Plain Python numbers whatever the caller kept (numpy scalars, 0-d tensors): the values
        # go into torch ops as scalars, where a numpy or tensor argument would cost a conversion.
        for name in ("growth_factor", "backoff_factor", "min_scale", "max_scale"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, as_real(name, value))
        for name in ("growth_interval", "hysteresis"):
            object.__setattr__(self, name, as_integer(name, getattr(self, name)))

    @property
    def floor(self) -> float:
        """The lowest scale a backoff reaches: ``min_scale``, else the smallest normal float32."""
        return SCALE_MIN if self.min_scale is None else max(self.min_scale, SCALE_MIN)


class RuleCache:
    """The :class:`ScaleRule` of a scaler's current settings, rebuilt only when one changed
    (torch's ``set_growth_factor`` and the like may change them between steps; building a rule
    checks every value, which is not free at every ``update()``)."""

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._rule: ScaleRule | None = None

    def get(
        self,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        hysteresis: int,
        min_scale: float | None,
        max_scale: float | None,
    ) -> ScaleRule:
        key = (growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale)
        if self._rule is None or key != self._key:
            self._key, self._rule = key, ScaleRule(*key)
        return self._rule


def update_scale_(
    rule: ScaleRule,
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    hysteresis_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    found_on_host: bool | None = None,
) -> torch.Tensor | bool:
    """Update the three trackers in place from ``found_inf`` (a float32 tensor, nonzero on an
    overflow, as torch's scalers keep it).

    Returns a 0-dim bool tensor, True when a backoff was due while the scale was already at its
    floor (:attr:`ScaleRule.floor`); the caller decides whether and when to read it. With
    ``found_on_host`` (the same decision, already read on the host: a CPU scaler) the same rule
    runs without the device ops that the known answer makes moot, and the result is a ``bool``.
    """
    floor = rule.floor
    if rule.hysteresis == 1 and rule.min_scale is None and found_on_host is not None:
        # A clean step can only grow the scale, and torch's kernel never grows it to inf: no
        # floor check, and a clamp only under a ceiling.
        # read on a skipped step only: no sync on the CPU, one on a device (skips are rare)
        at_floor = found_on_host and float(scale.item()) <= floor
        amp_update_scale_(
            scale,
            growth_tracker,
            found_inf,
            rule.growth_factor,
            rule.backoff_factor,
            rule.growth_interval,
        )
        if found_on_host or rule.max_scale is not None:
            scale.clamp_(min=floor, max=rule.max_scale)
        return at_floor
    if rule.hysteresis == 1 and rule.min_scale is None:
        # torch's fused update is one kernel instead of a dozen small ops (0.04 vs 0.3 ms on CPU);
        # the extras are the floor (and its flag) and the ceiling.
        underflow = (found_inf > 0) & (scale <= floor)
        amp_update_scale_(
            scale,
            growth_tracker,
            found_inf,
            rule.growth_factor,
            rule.backoff_factor,
            rule.growth_interval,
        )
        scale.clamp_(min=floor, max=rule.max_scale)
        return underflow
    found = found_inf > 0
    hyst_after = torch.where(found, hysteresis_tracker - 1, hysteresis_tracker)
    backoff = found & (hyst_after <= 0)
    successful = growth_tracker + 1
    grow = ~found & (successful >= rule.growth_interval)
    underflow = backoff & (scale <= floor)
    backed = (scale * rule.backoff_factor).clamp(min=floor)
    grown = scale * rule.growth_factor
    grown = torch.where(torch.isfinite(grown), grown, scale)  # as torch: never grow to inf
    if rule.max_scale is not None:
        grown = grown.clamp(max=rule.max_scale)
    scale.copy_(torch.where(backoff, backed, torch.where(grow, grown, scale)))
    growth_tracker.copy_(torch.where(found | grow, torch.zeros_like(growth_tracker), successful))
    refill = torch.full_like(hysteresis_tracker, rule.hysteresis)
    hysteresis_tracker.copy_(torch.where(grow, refill, hyst_after.clamp(min=0)))
    return underflow
