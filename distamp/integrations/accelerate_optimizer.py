"""The optimizer wrapper :class:`~distamp.integrations.accelerate.DistAMPAccelerator` returns from
``prepare``: Accelerate's ``AcceleratedOptimizer`` with the skip read from the scaler, and the
accelerator's step guards (``spike_guard``) consulted before the step.

Its own module because it is a class of its own that Accelerate builds and the accelerator
re-classes; the Accelerate version check runs here, first, for both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from typing_extensions import override

from distamp.versions import WINDOWS, check_version

SUPPORTED = WINDOWS["accelerate"]
"""The Accelerate releases this adapter was verified with (see :mod:`distamp.versions`)."""

ACCELERATE_VERSION = check_version("accelerate")

from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402  (after the version check)

from distamp.integrations.scaler_slot import SkipProbe  # noqa: E402

__all__ = ["ACCELERATE_VERSION", "SUPPORTED", "DistAMPOptimizer"]


class DistAMPOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper with the skip read from the scaler, not guessed.

    Accelerate's own wrapper decides "skipped" by whether ``optimizer.step`` was reached; a fused
    optimizer (``fused=True``) is always reached and skips inside its kernel, so a skip goes
    unreported and an attached LR scheduler steps anyway. Here the scaler's rank-agreed flag is
    kept (on device) after each real step and read only when :attr:`step_was_skipped` is asked.
    """

    _distamp_skipped: torch.Tensor | None = None
    _distamp_after_step: Callable[[Any, Any, bool], bool] | None = None
    _distamp_scaler_now: Callable[[], Any] | None = None
    _distamp_guard: Callable[[Any, Any], bool] | None = None

    def call_after_step(self, callback: Callable[[Any, Any, bool], bool] | None) -> None:
        """Have ``callback(scaler, overflow_flag, spike)`` called after each real optimizer step
        (not after an accumulation micro-step); it returns whether the step was a spike skip
        (an overflow as well wins). The accelerator counts its metrics and guards with it."""
        self._distamp_after_step = callback

    def guard_with(self, guard: Callable[[Any, Any], bool] | None) -> None:
        """Ask ``guard(scaler, optimizer)`` before each real step whether it takes the step
        over (a spike: it then skips the optimizer step and ends the scaler's iteration)."""
        self._distamp_guard = guard

    def follow_scaler(self, scaler_now: Callable[[], Any]) -> None:
        """Step with ``scaler_now()`` (the accelerator's ``scaler``, checked) at each real step,
        not with the scaler this wrapper was prepared with: ``accelerator.backward`` scales the
        loss with the accelerator's, so a replacement made after ``prepare`` must also unscale
        and step."""
        self._distamp_scaler_now = scaler_now

    @override
    def step(self, closure: Any = None) -> None:
        sync = self.gradient_state.sync_gradients
        if sync and self._distamp_scaler_now is not None:
            self.scaler = self._distamp_scaler_now()  # refused here, before the step, if unfit
        if not sync:
            super().step(closure)
            return  # an accumulation micro-step: Accelerate did not step
        probe, scaler = SkipProbe(), self.scaler
        probe.before(scaler)
        guard = self._distamp_guard
        spike = guard is not None and guard(scaler, self.optimizer)
        if not spike:  # a spike: skipped on every rank alike, by the guard
            super().step(closure)
        flag = None if scaler is None else probe.after(scaler)
        if self._distamp_after_step is not None:
            spike = self._distamp_after_step(scaler, flag, spike)
        self._distamp_skipped = torch.ones((), dtype=torch.bool) if spike else flag

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last optimizer step was skipped on every rank: inf/NaN gradients on
        any rank, or a spike (``spike_guard``); Accelerate's schedulers then do not step.

        One host sync (reads the scaler's on-device flag), only when asked.
        """
        flag = self._distamp_skipped
        return False if flag is None else bool(flag)  # host sync, on request
