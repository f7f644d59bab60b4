"""The scaler a plug-in keeps in its framework's public ``scaler`` attribute, honoured when
user code replaces it.

Lightning's precision plug-ins and Accelerate's ``Accelerator`` keep their loss scaler in a
public ``scaler`` attribute, and user code (and those frameworks' own tests) replace it after
construction: ``plugin.scaler = Mock(wraps=plugin.scaler)``, ``trainer.accelerator.scaler =
torch.amp.GradScaler()``. The frameworks then scale, unscale and step with whatever is there.
distamp's plug-ins do the same, so a replacement is never silently ignored:

- :func:`check_scaler` is asked, at the first step after a replacement and before anything of
  that step is applied, whether the scaler there can be honoured, and refuses it otherwise
  with the fix in the message;
- :class:`SkipProbe` reads whether the step was skipped from that very scaler: a
  :class:`~distamp.DistributedGradScaler`'s rank-agreed flag (no host sync), or for any other
  scaler the drop of its scale across ``update()``, which is how torch's ``GradScaler`` marks
  a skip (it backs off at every inf/NaN step) and how Accelerate reads it; one host sync a step.
"""

from __future__ import annotations

from typing import Any

import torch

from distamp.scaler import DistributedGradScaler

__all__ = ["GRADSCALER_METHODS", "SkipProbe", "check_scaler"]

GRADSCALER_METHODS = (
    "scale",
    "unscale_",
    "step",
    "update",
    "get_scale",
    "is_enabled",
    "state_dict",
    "load_state_dict",
)
"""What a loss scaler must offer to be stepped like ``torch.amp.GradScaler``."""


def check_scaler(scaler: Any, *, owner: str, needs_scaler: bool, pinned: Any = None) -> None:
    """Refuse a scaler the plug-in cannot honour; changes nothing.

    Args:
        scaler: what the plug-in's ``scaler`` attribute holds now.
        owner: the attribute, for the message (``"DistAMPTrainerPrecision.scaler"``).
        needs_scaler: fp16 (loss scaling): ``None`` would train fp16 with no loss scaling and
            let small gradients flush to zero. Without it (bf16) only ``None`` or a check-only
            :class:`~distamp.DistributedGradScaler` fits, as Lightning refuses a scaler for bf16.
        pinned: the scaler a policy's adaptive rules were started with (they watch it), or
            ``None``; another one there would leave them watching a scaler nobody steps.

    Raises:
        TypeError: the scaler is missing for fp16, or lacks ``torch.amp.GradScaler``'s methods.
        ValueError: a loss-scaling scaler with bf16, or a replacement of a pinned scaler.
    """
    if pinned is not None and scaler is not pinned:
        raise ValueError(
            f"{owner} was replaced by {scaler!r:.80} after the policy's adaptive rules started "
            "on the scaler they watch; replace it before the model is set up (or pass it as "
            "scaler=), or use a policy without adaptive rules and backward scales"
        )
    if scaler is None:
        if needs_scaler:
            raise TypeError(
                f"{owner} is None with fp16, which would train with no loss scaling (small "
                "gradients flush to zero); assign a distamp.DistributedGradScaler or a "
                "torch.amp.GradScaler, or train with 'bf16-mixed'"
            )
        return
    missing = [name for name in GRADSCALER_METHODS if not callable(getattr(scaler, name, None))]
    if missing:
        raise TypeError(
            f"{owner}={scaler!r:.80} is no loss scaler: it has no {', '.join(missing)}; assign "
            "a distamp.DistributedGradScaler (ranks agree on every skip) or a "
            "torch.amp.GradScaler"
        )
    check_only = isinstance(scaler, DistributedGradScaler) and scaler.check_only
    if not needs_scaler and not check_only:
        raise ValueError(
            f"{owner}={scaler!r:.80} with bf16, which needs no loss scaling; set it to None "
            "(or a distamp.DistributedGradScaler(check_only=True) to skip inf/NaN steps)"
        )


class SkipProbe:
    """Whether the last step of a scaler was skipped, read from the scaler that stepped.

    Call :meth:`before` right before ``scaler.step`` and :meth:`after` right after
    ``scaler.update()``.
    """

    def __init__(self) -> None:
        self._scale: float | None = None

    def before(self, scaler: Any) -> None:
        """Note the scale of a scaler that is not distamp's (one host sync: ``get_scale``)."""
        foreign = scaler is not None and not isinstance(scaler, DistributedGradScaler)
        self._scale = float(scaler.get_scale()) if foreign and scaler.is_enabled() else None

    def after(self, scaler: Any) -> torch.Tensor:
        """The skip flag (0-dim bool tensor): distamp's rank-agreed one (no host sync), or
        whether another scaler's scale dropped in ``update()`` (one host sync)."""
        before, self._scale = self._scale, None
        if isinstance(scaler, DistributedGradScaler):
            if not scaler.is_enabled():
                return torch.zeros((), dtype=torch.bool)
            return scaler.last_step_skipped
        if before is None:  # disabled, or no scaler: nothing can be skipped
            return torch.zeros((), dtype=torch.bool)
        return torch.tensor(float(scaler.get_scale()) < before)
