"""The loss scaler's scale and skip flag read as device tensors, for the DDP comm hooks.

Hooks that keep state across steps (PowerSGD's residuals and ``Q``, the fp8 hook's error
feedback) must repair it when the previous step was skipped or the scale changed, from inside a
hook call, without syncing with the host.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["current_loss_scale", "last_step_skipped"]


def current_loss_scale(scaler: Any) -> torch.Tensor | None:
    """The scaler's loss scale as its 0-dim device tensor, without a host sync.

    ``torch.amp.GradScaler`` keeps it in ``_scale`` and offers only ``get_scale()``, which
    syncs; this reads the tensor instead (checked on torch 2.4-2.13). ``None`` when there is no
    scaler, it is disabled (bf16/fp32) or it has not scaled anything yet.
    """
    if scaler is None or not scaler.is_enabled():
        return None
    scale = getattr(scaler, "_scale", None)
    return scale if isinstance(scale, torch.Tensor) else None


def last_step_skipped(scaler: Any, device: torch.device) -> torch.Tensor:
    """0-dim bool tensor on ``device``: whether the scaler skipped the previous step."""
    flag = getattr(scaler, "last_step_skipped", None) if scaler is not None else None
    if not isinstance(flag, torch.Tensor):
        return torch.zeros((), dtype=torch.bool, device=device)
    return flag.to(device=device, dtype=torch.bool, non_blocking=True)
