"""The rank-consistent GradScaler and its parts.

- :mod:`~distamp.scaler.grad_scaler`: :class:`DistributedGradScaler`, torch's state machine
  (READY -> UNSCALED -> STEPPED -> update) with one agreement per step;
- :mod:`~distamp.scaler.loss_scaling`: ``scale()`` and the pipeline schedules' scaled loss;
- :mod:`~distamp.scaler.torch_protocol`: the private members torch's code calls on a scaler,
  answered from the step agreement;
- :mod:`~distamp.scaler.registration`: the agreement's ranks and the registered modules;
- :mod:`~distamp.scaler.records`: the typed per-optimizer record of a step and its one agreement
  (:class:`~distamp.scaler.records.StepAgreement`: topology, gradient plans, records, collectives);
- :mod:`~distamp.scaler.scale_state` / :mod:`~distamp.scaler.scale_update`: the scale's device
  counters and the update rule (growth, backoff, hysteresis, bounds);
- :mod:`~distamp.scaler.grad_groups`: cached gradient groups per (device, dtype);
- :mod:`~distamp.scaler.clipping`: the one-pass clip;
- :mod:`~distamp.scaler.sync_free`: gating an optimizer step on the agreed flag (on device
  where the optimizer allows);
- :mod:`~distamp.scaler.reporting`: skips, overflow reports and state_dict;
- :mod:`~distamp.scaler.settings`: torch's setters, checked;
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
