"""The scaler's on-device counters beyond torch's scale and growth tracker, kept in one object.

torch's GradScaler owns ``_scale`` and ``_growth_tracker``; distamp adds five more numbers that
live on the same device and change at every ``update()``: the hysteresis tracker, the skip
counter, the current skip streak, whether the last step skipped, and whether the scale hit its
floor. They are created lazily (the device is known only at the first ``scale()``), updated
without host syncs, saved and loaded together, and dropped when pickled. One object keeps those
five life cycles in one place instead of five attributes with five ``None`` checks.
"""

from __future__ import annotations

from typing import Any

import torch

from distamp.scaler.config import SCALE_MIN

__all__ = ["ScaleState", "ScaleUnderflowError"]


class ScaleUnderflowError(RuntimeError):
    """The loss scale hit its floor (``min_scale``, else the smallest normal float32) and the
    gradients still overflow."""


class ScaleState:
    """distamp's per-scaler counters (see module doc).

    Args:
        hysteresis: the hysteresis tracker's starting (and refill) value.
    """

    def __init__(self, hysteresis: int) -> None:
        # Plain ints, range-checked by distamp.scaler.config: the tensors below are int32/int64.
        self.init_hysteresis = int(hysteresis)  # the tracker's value until the tensors exist
        self.init_skipped = 0
        self.hysteresis: torch.Tensor | None = None
        self.skipped: torch.Tensor | None = None
        self.streak: torch.Tensor | None = None
        self.last_skipped: torch.Tensor | None = None
        self.underflow: torch.Tensor | None = None

    @property
    def ready(self) -> bool:
        return self.skipped is not None

    def create(self, device: torch.device) -> None:
        """Allocate the counters on ``device`` from the pending initial values."""
        self.hysteresis = torch.full((), self.init_hysteresis, dtype=torch.int32, device=device)
        self.skipped = torch.full((), self.init_skipped, dtype=torch.int64, device=device)
        self.streak = torch.zeros((), dtype=torch.int64, device=device)
        self.last_skipped = torch.zeros((), dtype=torch.bool, device=device)
        self.underflow = torch.zeros((), dtype=torch.bool, device=device)

    def record(self, found: torch.Tensor) -> None:
        """Count one iteration whose agreed skip decision is ``found`` (0-dim bool). No sync."""
        assert self.skipped is not None and self.streak is not None
        self.skipped.add_(found)
        torch.mul(self.streak + 1, found, out=self.streak)  # +1 on a skip, else 0
        self.last_skipped = found

    def skipped_steps(self) -> int:
        """Skipped iterations so far (host sync when the counter exists)."""
        if self.skipped is None:
            return self.init_skipped
        return int(self.skipped.item())  # host sync, on request only

    def hysteresis_left(self) -> int:
        """The hysteresis tracker's value (host sync when it exists)."""
        if self.hysteresis is None:
            return self.init_hysteresis
        return int(self.hysteresis.item())  # host sync, on request only

    def state_dict(self) -> dict[str, Any]:
        """The counters that survive a checkpoint (the streak and flags are per-run)."""
        return {
            "_hysteresis_tracker": self.hysteresis_left(),
            "skipped_steps": self.skipped_steps(),
        }

    def load(self, hysteresis_tracker: int, skipped_steps: int) -> None:
        """Set the saved counters, now if the tensors exist, else at their creation."""
        self.init_hysteresis = int(hysteresis_tracker)
        self.init_skipped = int(skipped_steps)
        if self.hysteresis is not None and self.skipped is not None:
            self.hysteresis.fill_(self.init_hysteresis)
            self.skipped.fill_(self.init_skipped)

    def raise_if_underflow(self, min_scale: float | None) -> None:
        """Raise :class:`ScaleUnderflowError` if an overflow arrived at the floor (host sync).

        ``min_scale`` None: the floor is the smallest normal float32, where the scale stops
        instead of becoming subnormal or 0 (see :mod:`distamp.scaler.scale_update`).
        """
        if self.underflow is not None and bool(self.underflow.item()):  # host sync
            self.underflow.zero_()
            where = (
                f"min_scale={min_scale}"
                if min_scale is not None
                else f"its floor, the smallest normal float32 ({SCALE_MIN:.8g}; set min_scale "
                "to stop earlier)"
            )
            raise ScaleUnderflowError(
                f"the loss scale is at {where} and gradients still overflow. "
                "Likely causes: NaN/inf in the inputs or the loss itself (check the batch), a "
                "diverged model (lower the learning rate), or fp16 overflow in activations (use "
                "precision='bf16', or keep the overflowing module in fp32 with an AutocastPolicy)."
            )

    def detached(self) -> ScaleState:
        """A copy holding only the initial values (for pickling: tensors are re-created)."""
        copy = ScaleState(self.hysteresis_left())
        copy.init_skipped = self.skipped_steps()
        return copy
