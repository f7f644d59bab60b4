"""The engine's step guards in a framework's optimizer step: ``spike_guard`` and
``max_consecutive_skips`` for the plug-ins.

Why not a guard of their own: the decision must be the engine's, bit for bit (the same rolling
history, the same agreed loss, the same refusal of bad settings), so each plug-in drives the
engine's :class:`~distamp.engine.guards.StepGuards` through :class:`PluginGuards`, at the points
the framework hands it:

1. at each backward, :meth:`PluginGuards.record_loss` adds the micro-batch's loss to the
   plug-in's metrics (only while a spike guard watches; the step's loss is then the mean over its
   micro-batches, as in the engine);
2. before the scaler's step, :meth:`PluginGuards.before` decides (one small all-reduce and one
   host sync, identical on every rank);
3. on a spike, :meth:`PluginGuards.skip` replaces the framework's optimizer step: no optimizer
   step, and the scaler's iteration ends as after any step with finite gradients (unscaled if it
   was not, then updated: not backed off);
4. after the scaler's update, :meth:`PluginGuards.after` confirms the spike (an overflow in the
   same step wins), counts it in the metrics (``spike_skips``) and in the skip streak, and raises
   :class:`~distamp.ConsecutiveSkipsError` at the limit, on every rank at the same step.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from distamp.engine.guards import SpikeGuard, StepGuards, check_guards
from distamp.observe.metrics import AMPMetrics

__all__ = ["PluginGuards"]


class PluginGuards:
    """A plug-in's spike guard and consecutive-skip limit (see the module doc).

    Args:
        spike_guard: a :class:`~distamp.SpikeGuard`, or ``None``.
        max_consecutive_skips: the most skipped steps in a row (overflow and spike alike), or
            ``None``; 100 by default in every plug-in, as in :class:`~distamp.DistAMP`.

    Raises:
        ArgumentTypeError: ``spike_guard`` is no :class:`~distamp.SpikeGuard`, or the limit no
            integer (:func:`~distamp.engine.guards.check_guards`).
        ValueError: the limit is out of range, naming the field.
    """

    def __init__(self, spike_guard: SpikeGuard | None, max_consecutive_skips: int | None) -> None:
        limit = check_guards(spike_guard, max_consecutive_skips)
        self.spike_guard = spike_guard
        self.max_consecutive_skips = limit
        self.guards = StepGuards(spike_guard, limit)
        self.steps = 0  # optimizer steps seen, for the skip's log line

    def settings(self) -> dict[str, Any]:
        """The settings every rank must share (for the plug-in's settings agreement)."""
        guard = self.spike_guard
        return {
            "spike_guard": None if guard is None else repr(guard),
            "max_consecutive_skips": self.max_consecutive_skips,
        }

    def record_loss(self, metrics: AMPMetrics, loss: torch.Tensor) -> None:
        """Add one micro-batch's loss to the step's (only while a spike guard watches: no
        work otherwise). No host sync."""
        if self.guards.spike is not None and isinstance(loss, torch.Tensor):
            metrics.record(loss)

    def before(self, metrics: AMPMetrics, norm: torch.Tensor | None, scaler: Any) -> bool:
        """Whether this step is a spike (``False`` without a spike guard, with no work).

        Args:
            metrics: the plug-in's metrics, holding the step's recorded losses.
            norm: the clipping norm, only where it is agreed across ranks (a distamp scaler's
                ``clip_grad_norm_``), else ``None``: the guard then watches the loss alone.
            scaler: the scaler in the plug-in's ``scaler`` slot (any, or ``None``).
        """
        return self.guards.before_step(metrics.step_loss, norm, scaler, self.steps)

    @staticmethod
    def skip(scaler: Any, optimizer: torch.optim.Optimizer, *, unscaled: bool) -> None:
        """A spike skip in place of the framework's step: the optimizer does not step; the
        scaler unscales (unless ``unscaled``: clipping or the user did it this step) to read the
        overflow flags, and its update ends the iteration as for any finite step."""
        if scaler is None:
            return
        if not unscaled and hasattr(scaler, "clip_grad_norm_"):
            # distamp's scaler reads the flags without dividing 16-bit gradients in place (fp16
            # weights refuse unscale_), as the engine's spike path does
            scaler.clip_grad_norm_(optimizer, math.inf)
        elif not unscaled:
            scaler.unscale_(optimizer)
        scaler.update()

    def after(
        self,
        metrics: AMPMetrics,
        scaler: Any,
        *,
        spike: bool,
        overflow: torch.Tensor | None,
        norm: torch.Tensor | None,
    ) -> bool:
        """Close the step: whether it was skipped for a spike (an overflow as well wins), the
        metrics counted (``spike_skips``), the streak recorded.

        Args:
            overflow: the step's overflow flag as the plug-in read it from the scaler there
                (0-dim bool tensor), ``None`` when nothing could overflow (no scaler).

        Raises:
            ConsecutiveSkipsError: ``max_consecutive_skips`` steps in a row were skipped.
        """
        flag = torch.zeros((), dtype=torch.bool) if overflow is None else overflow
        spike = spike and self.guards.confirm(scaler, flag)
        metrics.step(scaler, norm, spike)
        self.steps += 1
        self.guards.after_step(scaler, decided=False, overflow=flag)
        return spike
