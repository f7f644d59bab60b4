"""What a :class:`~distamp.DistributedGradScaler` reports and persists.

Skip counters and the last decision (on device, read on request), the overflow report, and the
state that survives a checkpoint or a pickle. The scaler's base class, kept apart from its state
machine (scale -> unscale -> step -> update) in :mod:`distamp.scaler`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from typing_extensions import override

from distamp.agreement import reduction
from distamp.observe.diagnostics import (
    NonFiniteTracer,
    OverflowRecorder,
    OverflowReport,
    build_report,
)
from distamp.scaler.config import validate_state_dict
from distamp.scaler.records import StepAgreement, StepWatcher
from distamp.scaler.scale_state import ScaleState
from distamp.torch_compat import grad_scaler_scale

__all__ = ["ScalerReporting"]

_log = logging.getLogger("distamp.scaler")


class ScalerReporting(torch.amp.GradScaler):
    """Reporting and persistence of the scaler (see module doc); the base of
    :class:`~distamp.DistributedGradScaler`, which sets these attributes."""

    _check_only: bool
    _sync_free: bool
    _hysteresis: int
    _min_scale: float | None
    _max_scale: float | None
    _counters: ScaleState
    _steps: StepAgreement
    _overflow: OverflowRecorder | None
    _tracer: NonFiniteTracer | None

    @property
    def min_scale(self) -> float | None:
        """The floor of the scale (``None``: none)."""
        return self._min_scale

    @property
    def max_scale(self) -> float | None:
        """The ceiling of the scale (``None``: none, as torch)."""
        return self._max_scale

    @property
    def device_type(self) -> str:
        """The device type the scaler was built for ("cuda", "cpu"...)."""
        return str(self._device)

    def settings(self) -> dict[str, Any]:
        """What must be identical on every rank that agrees (compared once at setup by the
        engine and the plug-ins). Host sync: reads the scale."""
        if not self._enabled:  # torch keeps no factors for a disabled scaler
            return {"scaler.enabled": False, "scaler.check_only": self._check_only}
        return {
            "scaler.enabled": self._enabled,
            "scaler.check_only": self._check_only,
            "scaler.sync_free": self._sync_free,
            "scaler.scale": self.get_scale(),
            "scaler.growth_factor": self._growth_factor,
            "scaler.backoff_factor": self._backoff_factor,
            "scaler.growth_interval": self._growth_interval,
            "scaler.hysteresis": self._hysteresis,
            "scaler.min_scale": self._min_scale,
            "scaler.max_scale": self._max_scale,
        }

    @property
    def check_only(self) -> bool:
        """Whether this scaler only checks (bf16/fp32: no scaling, non-finite steps skipped)."""
        return self._check_only

    @property
    def last_step_skipped(self) -> torch.Tensor:
        """0-dim bool tensor: whether the last step/update skipped (no host sync to get it)."""
        last = self._counters.last_skipped
        if last is None:
            return torch.zeros((), dtype=torch.bool)
        return last if last.dtype == torch.bool else last > 0

    @property
    def scale_tensor(self) -> torch.Tensor | None:
        """The current scale as the scaler's own device tensor (``None`` before the first
        ``scale()``), read without a host sync: what a comm hook or a step's result reads every
        step, where :meth:`get_scale` waits for the device. ``update()`` changes it: clone it to
        keep a step's value, and never write it (the scale's bounds are kept by ``update``)."""
        return grad_scaler_scale(self)

    @property
    def skipped_steps(self) -> int:
        """Number of skipped iterations since the start (synced: reads a device counter)."""
        if not self._enabled:
            return 0
        return self._counters.skipped_steps()

    @property
    def skip_streak(self) -> int:
        """Consecutive skipped iterations up to the last ``update()`` (synced: read on request)."""
        return self._counters.skip_streak()  # host sync on a device, on request only

    def attach_tracer(self, tracer: NonFiniteTracer | None) -> None:
        """Follow a :class:`~distamp.observe.diagnostics.NonFiniteTracer`: its forward record is
        kept
        for skipped steps and appears in :meth:`overflow_report`. ``None`` detaches."""
        self._tracer = tracer

    def set_grad_exponents(self, exponents: Mapping[torch.Tensor, int] | None) -> None:
        """Each parameter's gradient arrives multiplied by ``2**k`` on top of the loss scale
        (per-block backward scales, :mod:`distamp.precision.backward_scales`): unscale it by
        ``2**-k`` too, in the same one pass (the gradients grouped by factor). ``None`` or
        empty: every ``k`` is 0. Set it identically on every rank, between steps."""
        self._steps.plans.set_exponents(
            {} if exponents is None else {id(p): int(k) for p, k in exponents.items()}
        )

    def attach_rider(self, rider: reduction.Rider | None) -> None:
        """Let ``rider``'s statistics (:class:`~distamp.observe.numerics.NumericMonitor`) travel
        in each step's one flag collective, over the agreement group even where a registered DDP
        module would have made that collective unnecessary. ``None`` detaches."""
        self._steps.rider = rider

    def attach_watcher(self, watcher: StepWatcher | None) -> None:
        """Have ``watcher`` told where each step begins (before the first gradient is read or
        unscaled) and ends (after ``update()``), whoever drives this scaler: the adaptive run
        (:class:`~distamp.precision.adaptive_run.AdaptiveRun`) uses it so that the engine and
        every framework plug-in apply the same rules at the same points. One watcher at a time:
        attaching a second while one is attached raises ``RuntimeError``; ``None`` detaches."""
        if watcher is not None and self._steps.watcher not in (None, watcher):
            raise RuntimeError(
                "this scaler already drives an adaptive run (one model's rules per scaler): "
                "close that engine or plug-in first, or give each model its own scaler"
            )
        self._steps.watcher = watcher

    def overflow_report(self) -> OverflowReport | None:
        """Which parameters (and modules, ranks, inf or NaN) overflowed at the last skipped step.

        Reads the per-gradient flags the unscale pass kept on device (nothing is computed again)
        and gathers every rank's, so the report is the same on every rank. Host syncs and, with a
        process group, one gather: call it on every rank, on request or after a skip (the engine
        does it at a logging step whose window skipped). Parameter names come from
        :meth:`register_module`. ``None`` when no step was skipped (or ``report_overflow=False``).
        """
        if not self._enabled or self._overflow is None:
            return None
        topology = self._steps.topology
        group = topology.process_group
        return build_report(
            self._overflow,
            topology.param_names,
            self._overflow.params(),
            group if _is_process_group(group) else None,
            self._tracer,
        )

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        """torch's keys plus hysteresis, bounds and the skip counter; identical on every rank.

        Plain Python numbers only (the constructor normalised numpy and tensor arguments), so
        ``torch.load(..., weights_only=True)`` reads it back. Host sync (reads the scale)."""
        if not self._enabled:
            return {}
        sd = super().state_dict()
        sd.update(
            hysteresis=self._hysteresis,
            min_scale=self._min_scale,
            max_scale=self._max_scale,
            **self._counters.state_dict(),
        )
        return sd

    def check_state_dict(self, state_dict: Any) -> dict[str, Any]:
        """Check a state as :meth:`load_state_dict` would, without loading it: returns it
        normalised (plain numbers, distamp's keys filled in), or raises ``ValueError`` naming the
        key. Lets a caller check a whole checkpoint before applying any part of it."""
        return validate_state_dict(
            state_dict,
            default_hysteresis=self._hysteresis,
            min_scale=self._min_scale,
            max_scale=self._max_scale,
        )

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from this class or from ``torch.amp.GradScaler.state_dict()``.

        Works before the first ``scale()``. Malformed input, or a value that does not fit where
        it is kept (a scale outside normal float32 or outside the bounds, a tracker beyond int32:
        the ranges of :mod:`distamp.scaler.config`), raises ``ValueError`` naming the key, and
        nothing is changed: every value is checked before the first one is set. A state without
        bounds (torch's) keeps this scaler's.
        """
        if not self._enabled:
            return
        sd = self.check_state_dict(state_dict)
        if self._check_only and sd["scale"] != 1.0:
            # A loss-scaling (fp16) run's state: its scale means nothing here, and a fused step
            # would divide every gradient by it. Said once, and the scale stays 1.
            _log.warning(
                "a check-only scaler (bf16/fp32/fp8: no loss scaling) was given the state of a "
                "loss-scaling one (scale %g): the scale stays 1, the rest is kept",
                sd["scale"],
            )
            sd = {**sd, "scale": 1.0, "_growth_tracker": 0}
        super().load_state_dict(sd)
        self._hysteresis = sd["hysteresis"]
        self._counters.load(sd["_hysteresis_tracker"], sd["skipped_steps"])
        self._min_scale, self._max_scale = sd["min_scale"], sd["max_scale"]

    @override
    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        if self._enabled:
            state["_counters"] = self._counters.detached()
        # Process groups and module hooks do not survive pickling (the step agreement drops
        # them, see StepAgreement.__reduce__); they are re-resolved lazily.
        state["_replicas"] = None  # a torchft Manager does not pickle either
        state["_overflow"] = (
            None if self._overflow is None else OverflowRecorder(lazy=not self._sync_free)
        )
        state["_tracer"] = None
        return state


def _is_process_group(group: Any) -> bool:
    return group is not None and isinstance(group, torch.distributed.ProcessGroup)
