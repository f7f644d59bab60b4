"""The settings torch lets a user change after construction, held to the constructor's checks.

``torch.amp.GradScaler`` offers ``set_growth_factor``, ``set_backoff_factor`` and
``set_growth_interval``, and stores whatever they are given: ``set_backoff_factor(2.0)`` then
doubles the scale at every overflow until it reaches inf, ``set_growth_factor(0.5)`` halves it on
clean steps, ``set_growth_interval(0)`` stops growth for good. Here the same setters check their
argument with the constructor's rules (:mod:`distamp.scaler.config`): a ``ValueError`` naming the
argument and echoing the value, and nothing changed; numbers are taken as torch takes them (numpy
scalars, 0-d tensors; not ``bool``). The scale's update rule is rebuilt from these attributes when
one of them changes (:class:`distamp.scaler.scale_update.RuleCache`), so the next ``update()``
uses the new value.
"""

from __future__ import annotations

import torch
from typing_extensions import override

from distamp.scaler.config import (
    check_backoff_factor,
    check_growth_factor,
    check_growth_interval,
)

__all__ = ["ScalerSettings"]


class ScalerSettings(torch.amp.GradScaler):
    """torch's setters, checked (see module doc); a base of
    :class:`~distamp.DistributedGradScaler`. None of them syncs the host."""

    @override
    def set_growth_factor(self, new_factor: float) -> None:
        """Set the factor the scale grows by after ``growth_interval`` clean steps.

        Args:
            new_factor: ``1 < new_factor <= 3.4028235e38``, as the constructor's
                ``growth_factor`` (``ValueError`` otherwise, and the factor is kept).
        """
        self._growth_factor = check_growth_factor(new_factor)

    @override
    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the factor the scale backs off by on an overflow.

        Args:
            new_factor: ``0 < new_factor < 1``, as the constructor's ``backoff_factor``
                (``ValueError`` otherwise, and the factor is kept).
        """
        self._backoff_factor = check_backoff_factor(new_factor)

    @override
    def set_growth_interval(self, new_interval: int) -> None:
        """Set how many clean steps in a row grow the scale.

        Lowering the interval to or below the clean steps already counted leaves the growth
        tracker at ``new_interval - 1``: those steps already make the scale due to grow, so the
        next clean step grows it. Left as it was, the tracker would have passed the interval, and
        torch's update grows only when ``tracker + 1`` equals it: the scale would never grow
        again. The tracker is clamped on its device (no host sync).

        Args:
            new_interval: an integer in ``[1, 2**31 - 1]``, as the constructor's
                ``growth_interval`` (``ValueError`` otherwise, and nothing changes).
        """
        interval = check_growth_interval(new_interval)
        self._growth_interval = interval
        if not self._enabled:  # torch's disabled scaler has no tracker
            return
        self._init_growth_tracker = min(self._init_growth_tracker, interval - 1)
        if self._growth_tracker is not None:
            self._growth_tracker.clamp_(max=interval - 1)
