"""Scaling the loss: the first state of a :class:`~distamp.DistributedGradScaler`'s step.

``scale()`` multiplies the loss (or nested outputs) by the scale and creates the scale where the
first loss lives; ``scaled_loss_fn()`` does the same inside a ``torch.distributed.pipelining``
schedule, whose stages before the last never see a loss, so it creates the scale up front on the
scaler's own device (``_home_device``). Kept apart from the state machine that
follows (unscale -> step -> update, :mod:`distamp.scaler.grad_scaler`): scaling reads the scale
and never changes the per-optimizer state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from typing_extensions import override

__all__ = ["LossScaling"]


class LossScaling(torch.amp.GradScaler):
    """``scale()`` and ``scaled_loss_fn()`` (see module doc); a base of
    :class:`~distamp.DistributedGradScaler`, which sets ``_check_only``. No host sync."""

    _check_only: bool

    def _home_device(self) -> torch.device:
        """Where the scale is created when no loss says so (a check-only scaler, a pipeline
        stage without a loss): the scaler's device, "cuda" meaning the current CUDA device."""
        device = torch.device(self._device)
        unnumbered = device.type == "cuda" and device.index is None
        return torch.device("cuda", torch.cuda.current_device()) if unnumbered else device

    @override
    def scale(self, outputs: Any) -> Any:
        """Multiply a tensor, or a (nested) list/tuple/iterable of tensors, by the scale.

        Same contract as torch's; defined here rather than inherited because ``torch.compile``
        refuses to trace torch's own GradScaler methods (a graph break at every ``scale()``),
        while it traces this one. No host sync.
        """
        if not self._enabled:
            return outputs
        if self._check_only:
            if self._scale is None:
                self._lazy_init_scale_growth_tracker(self._home_device())
            return outputs
        per_device: dict[torch.device, torch.Tensor] = {}

        def factor(device: torch.device) -> torch.Tensor:
            if self._scale is None:
                self._lazy_init_scale_growth_tracker(device)
            assert self._scale is not None
            if device not in per_device:
                per_device[device] = self._scale.to(device=device, non_blocking=True)
            return per_device[device]

        def apply(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return value * factor(value.device)
            if isinstance(value, (list, tuple)):
                return type(value)(apply(v) for v in value)
            if isinstance(value, Iterable):
                return map(apply, value)
            raise ValueError(
                f"scale() takes a Tensor or an iterable of Tensors, got {type(value).__name__}"
            )

        return apply(outputs)

    def scaled_loss_fn(self, loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """Wrap ``loss_fn`` for a ``torch.distributed.pipelining`` schedule: each micro-batch loss
        is multiplied by the scale, so backward inside the schedule produces scaled gradients on
        every stage. The schedule's own micro-batch scaling (``scale_grads``) is left as it is.

        The scale is created now, on this scaler's device, so that stages that never compute a
        loss can still ``unscale_``/``step``/``update``; every stage then joins the one collective
        of the step. The losses the schedule returns are scaled: divide by :meth:`get_scale` (or
        use the unscaled value your ``loss_fn`` logs) for display.
        """
        if not callable(loss_fn):
            raise TypeError(f"scaled_loss_fn() takes a callable loss function, got {loss_fn!r}")
        if self._enabled and self._scale is None:
            self._lazy_init_scale_growth_tracker(self._home_device())

        def scaled(*args: Any, **kwargs: Any) -> torch.Tensor:
            return self.scale(loss_fn(*args, **kwargs))  # type: ignore[no-any-return]

        return scaled
