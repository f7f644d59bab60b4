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
        # On the host (``create(..., on_host=True)``): the skip counter and streak as ints.
        self.on_host = False
        self.skipped_count = 0
        self.streak_count = 0

    @property
    def ready(self) -> bool:
        return self.hysteresis is not None

    def create(self, device: torch.device, on_host: bool = False) -> None:
        """Allocate the counters on ``device`` from the pending initial values. ``on_host``: the
        caller reads each step's decision on the host anyway (a CPU scaler, or a device one
        that copies its agreed flags to the host), so the skip counter and streak are plain ints
        there instead of two tensors and three ops per step."""
        self.hysteresis = torch.full((), self.init_hysteresis, dtype=torch.int32, device=device)
        self.on_host = on_host
        if on_host:
            self.skipped_count, self.streak_count = self.init_skipped, 0
        else:
            self.skipped = torch.full((), self.init_skipped, dtype=torch.int64, device=device)
            self.streak = torch.zeros((), dtype=torch.int64, device=device)
        self.last_skipped = torch.zeros((), dtype=torch.bool, device=device)
        self.underflow = torch.zeros((), dtype=torch.bool, device=device)

    def record(self, found: torch.Tensor, found_on_host: bool | None = None) -> None:
        """Count one iteration whose agreed skip decision is ``found`` (a tensor, nonzero on a
        skip). No sync; ``found_on_host`` is the same decision already read on the host."""
        if self.on_host:
            assert found_on_host is not None
            self.skipped_count += int(found_on_host)
            self.streak_count = self.streak_count + 1 if found_on_host else 0
        else:
            assert self.skipped is not None and self.streak is not None
            self.skipped.add_(found)
            torch.mul(self.streak + 1, found, out=self.streak)  # +1 on a skip, else 0
        # As a bool once here, not at each read: the engine's step reads it three times.
        self.last_skipped = found if found.dtype == torch.bool else found > 0

    def flag_underflow(self, underflow: torch.Tensor | bool) -> None:
        """Remember that a backoff arrived at the floor (raised by :meth:`raise_if_underflow`)."""
        assert self.underflow is not None
        if isinstance(underflow, torch.Tensor):
            self.underflow |= underflow
        elif underflow:
            self.underflow.fill_(True)

    def skipped_steps(self) -> int:
        """Skipped iterations so far (host sync when the counter is a device tensor)."""
        if self.on_host:
            return self.skipped_count
        if self.skipped is None:
            return self.init_skipped
        return int(self.skipped.item())  # host sync, on request only

    def skip_streak(self) -> int:
        """Consecutive skipped iterations up to the last update (host sync on a device)."""
        if self.on_host:
            return self.streak_count
        return 0 if self.streak is None else int(self.streak.item())  # on request only

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
        if self.hysteresis is not None:
            self.hysteresis.fill_(self.init_hysteresis)
        if self.on_host:
            self.skipped_count = self.init_skipped
        elif self.skipped is not None:
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
