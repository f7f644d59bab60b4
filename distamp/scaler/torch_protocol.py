"""The private members torch's own code calls on a GradScaler, answered from the step agreement.

torch's optimizers and drop-in code written against torch's scaler do not only call the public
methods: an optimizer of the older protocol (``step(grad_scaler=...)``) asks the scaler for
``_check_inf_per_device`` and ``_found_inf_per_device``; ``ShardedGradScaler``-style callers
call ``_unscale_grads_``; torch's ``__init__`` and ``update(new_scale)`` assign
``_per_optimizer_states``. Here each of them is routed to the scaler's
:class:`~distamp.scaler.records.StepAgreement`, so that whatever torch or a framework calls, the
flags it reads are the ones agreed across ranks. Kept apart from the state machine
(:mod:`distamp.scaler.grad_scaler`), which drives the same agreement through its public face.
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from distamp.observe.diagnostics import OverflowRecorder
from distamp.scaler.grad_groups import check_groups_
from distamp.scaler.records import OptimizerStep, StepAgreement

__all__ = ["TorchProtocol"]


class TorchProtocol(torch.amp.GradScaler):
    """torch's private GradScaler members over the step agreement (see module doc); a base of
    :class:`~distamp.DistributedGradScaler`, which sets these attributes."""

    _steps: StepAgreement
    _overflow: OverflowRecorder | None

    @property
    def _per_optimizer_states(self) -> dict[int, Any]:  # type: ignore[override]
        """torch's per-optimizer state (its code and drop-in code read it): this iteration's
        records, kept by the step agreement."""
        return self._steps.records

    @_per_optimizer_states.setter
    def _per_optimizer_states(self, value: dict[int, Any]) -> None:
        # torch's __init__ and update(new_scale) assign an empty dict to start an iteration.
        self._steps.new_iteration()
        self._steps.records.update(value)

    @override
    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor | None,
        found_inf: torch.Tensor,
        allow_fp16: bool = True,
    ) -> dict[torch.device, torch.Tensor]:
        """torch's hook: unscale (``inv_scale`` None: only check) the optimizer's gradients in
        one pass per group (see check_groups_); returns the local flags per device.
        ``allow_fp16`` defaults to True as in ``ShardedGradScaler``, whose callers omit it. As in
        torch, the caller decides which gradients it takes: the refusal of 16-bit parameters
        without a master (:mod:`~distamp.scaler.master_dtypes`) belongs to the scaler's own
        ``unscale_``, ``step`` and clip, which every optimizer step goes through."""
        plan = self._steps.plans.for_optimizer(optimizer)
        with torch.no_grad():
            groups = plan.groups(
                allow_fp16=allow_fp16, by_factor=inv_scale is not None, masters=False
            )
            return check_groups_(groups, found_inf, inv_scale, self._overflow)

    def _check_inf(self, optimizer: torch.optim.Optimizer) -> OptimizerStep:
        """Read-only non-finite check for fused optimizers, which unscale inside their kernel."""
        scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        record = self._steps.record(optimizer)
        self._steps.check_(
            optimizer, record, scale.device, None, allow_fp16=True, recorder=self._overflow
        )
        return record

    @override
    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """torch's hook for optimizers that handle scaling themselves; returns the agreed flags."""
        return self._check_inf(optimizer).found_inf_per_device  # type: ignore[return-value]

    @override
    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return self._steps.record(optimizer).found_inf_per_device  # type: ignore[return-value]
