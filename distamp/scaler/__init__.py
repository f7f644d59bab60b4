"""The rank-consistent GradScaler and its parts.

- :mod:`~distamp.scaler.grad_scaler`: :class:`DistributedGradScaler`, torch's state machine
  (READY -> UNSCALED -> STEPPED -> update) with one agreement per step;
- :mod:`~distamp.scaler.records`: the typed per-optimizer record of a step and its one agreement
  (:class:`~distamp.scaler.records.StepAgreement`: topology, gradient plans, records, collectives);
- :mod:`~distamp.scaler.scale_state` / :mod:`~distamp.scaler.scale_update`: the scale's device
  counters and the update rule (growth, backoff, hysteresis, bounds);
- :mod:`~distamp.scaler.grad_groups`: cached gradient groups per (device, dtype);
- :mod:`~distamp.scaler.clipping`: the one-pass clip;
- :mod:`~distamp.scaler.sync_free`: gating an optimizer step on device;
- :mod:`~distamp.scaler.reporting`: skips, overflow reports and state_dict;
- :mod:`~distamp.scaler.config`: argument checks.
"""

from __future__ import annotations

from distamp.scaler.grad_scaler import (
    DistributedGradScaler,
    OptimizerStep,
    ScalerStateError,
    ScaleUnderflowError,
)

__all__ = ["DistributedGradScaler", "OptimizerStep", "ScaleUnderflowError", "ScalerStateError"]
