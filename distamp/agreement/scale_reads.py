"""The loss scaler's scale and skip flag read as device tensors: one reader for every caller.

Hooks that keep state across steps (PowerSGD's residuals and ``Q``, the fp8 hook's error
feedback) must repair it when the previous step was skipped or the scale changed, from inside a
hook call, without syncing with the host; the engine's step result keeps the scale of its step
the same way and reads it only when asked. Both read it here, whichever scaler they were given.
"""

from __future__ import annotations

from typing import Any

import torch

from distamp.torch_compat import grad_scaler_scale

__all__ = ["current_loss_scale", "last_step_skipped"]

_NO_ACCESSOR = object()  # a scaler without distamp's public ``scale_tensor``


def current_loss_scale(scaler: Any) -> torch.Tensor | None:
    """The scaler's loss scale as its device tensor, without a host sync: the one way distamp
    reads a scale it does not own (the comm hooks, the engine's step results).

    A :class:`~distamp.DistributedGradScaler` hands it out through its public ``scale_tensor``.
    torch's ``GradScaler`` (and ``ShardedGradScaler``) offers only ``get_scale()``, which syncs:
    :func:`distamp.torch_compat.grad_scaler_scale` reads its tensor. ``None`` when there is no
    scaler, it is disabled (bf16/fp32) or it has not scaled anything yet. The tensor changes
    with the scaler's next ``update()``: clone it to keep a value.
    """
    if scaler is None or not scaler.is_enabled():
        return None
    scale = getattr(scaler, "scale_tensor", _NO_ACCESSOR)
    if scale is _NO_ACCESSOR:
        scale = grad_scaler_scale(scaler)
    return scale if isinstance(scale, torch.Tensor) else None


def last_step_skipped(scaler: Any, device: torch.device) -> torch.Tensor:
    """0-dim bool tensor on ``device``: whether the scaler skipped the previous step."""
    flag = getattr(scaler, "last_step_skipped", None) if scaler is not None else None
    if not isinstance(flag, torch.Tensor):
        return torch.zeros((), dtype=torch.bool, device=device)
    return flag.to(device=device, dtype=torch.bool, non_blocking=True)
