"""One iteration's per-optimizer records, and how their flags become ONE agreed flag.

torch's GradScaler keeps a dict per optimizer whose keys appear along the way (``"stage"``,
``"found_inf_per_device"``); here each optimizer gets a typed :class:`OptimizerStep`, created on
first use by :class:`StepRecords` and dropped at ``update()``. :func:`agree_pending` packs the
local flags of every record still waiting into one tensor, reduces it in one collective
(:mod:`distamp.parallel.reduction`) and hands every record the same agreed flag.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from distamp.parallel import reduction

__all__ = [
    "OptimizerStep",
    "ScalerStateError",
    "StepRecords",
    "agree_pending",
    "is_fused",
    "reciprocal",
]


class ScalerStateError(RuntimeError, AssertionError):
    """A scaler method was called out of order.

    Subclasses ``AssertionError`` too, because torch's GradScaler raises that type for the same
    misuse (e.g. ``step()`` before ``scale()``) and drop-in code may catch it.
    """


@dataclass(eq=False)
class OptimizerStep:
    """One optimizer's progress through the current iteration (READY -> UNSCALED -> STEPPED).

    ``local_flags`` are this rank's non-finite flags, one per device, not yet agreed;
    ``found_inf`` is the rank-agreed flag once the step's one collective ran. ``grad_scale`` is
    what a fused optimizer must divide by after clipping (the clip divisor, times the scale when
    unscaling was deferred into its step). Subscripting with torch's keys (``"stage"``,
    ``"found_inf_per_device"``) works as on torch's per-optimizer dict, so code written against
    torch's scaler internals keeps working; reading ``found_inf_per_device`` returns the agreed
    flag, running the step's collective first if it has not run yet.
    """

    stage: OptState = OptState.READY
    local_flags: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    found_inf: torch.Tensor | None = None
    grad_scale: torch.Tensor | None = None
    clipped: bool = False
    ddp_covered: bool = False
    agree: Callable[[], Any] | None = None

    @property
    def pending(self) -> bool:
        """Whether local flags wait for the collective."""
        return bool(self.local_flags) and self.found_inf is None

    @property
    def found_inf_per_device(self) -> dict[torch.device, torch.Tensor]:
        if self.pending and self.agree is not None:
            self.agree()  # the step's one collective, for every optimizer unscaled so far
        if self.found_inf is not None:
            return {self.found_inf.device: self.found_inf}
        return self.local_flags

    def __getitem__(self, key: str) -> Any:
        if key == "stage":
            return self.stage
        if key == "found_inf_per_device":
            return self.found_inf_per_device
        raise KeyError(key)

    def __setitem__(self, key: str, value: Any) -> None:
        if key == "stage":
            self.stage = value
        elif key == "found_inf_per_device":
            self.local_flags, self.found_inf = dict(value), None
        else:
            raise KeyError(key)


class StepRecords(dict):  # type: ignore[type-arg]
    """``id(optimizer) -> OptimizerStep``, creating records on first access (as torch's
    defaultdict) that call their owner's ``_reduce_pending`` for the lazy agreement. The
    dict holds its owner weakly; each record's bound method is a cycle the collector frees."""

    def __init__(self, owner: Any) -> None:
        super().__init__()
        self._owner = weakref.ref(owner)

    def __missing__(self, key: int) -> OptimizerStep:
        owner = self._owner()
        record = OptimizerStep(agree=None if owner is None else owner._reduce_pending)
        self[key] = record
        return record


def agree_pending(
    pending: list[OptimizerStep],
    reducer: reduction.FlagReducer,
    home: torch.device,
    extra: torch.Tensor | None = None,
    extra_op: str = "max",
) -> torch.Tensor | None:
    """Reduce the local flags of ``pending`` (and ``extra``, a norm term) in ONE collective over
    ``reducer``; every record gets the same agreed flag, on ``home``. Returns the reduced
    ``extra``.

    The order of records is the order in which the optimizers were unscaled, the same on every
    rank in SPMD code, so the packed tensor lines up across ranks.
    """
    local = []
    for record in pending:
        flags = [f.to(home, non_blocking=True) for f in record.local_flags.values()]
        local.append(flags[0] if len(flags) == 1 else torch.stack(flags).amax())
    agreed, extra = reduction.reduce_flags(reducer, local, extra, extra_op)
    if agreed:
        # Optimizers unscaled together are skipped together: whatever ran between unscale_ and
        # step (typically one clip_grad_norm_ over all parameters) mixed their gradients, so an
        # inf in one made the others' gradients rank-dependent (clip coefficient 0 on one rank).
        flag = agreed[0] if len(agreed) == 1 else torch.stack(agreed).amax()
        for record in pending:
            record.found_inf = flag
    return extra


def is_fused(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer takes ``grad_scale``/``found_inf`` (torch's fused=True ones)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` as fp32. FP32 division can be imprecise for some scales: the reciprocal is
    taken in FP64 (as torch does)."""
    return scale.double().reciprocal().float() if scale.device.type != "mps" else scale.reciprocal()
