"""Learning-rate schedulers that follow the optimizer steps that really happened.

Lightning's Trainer steps every ``interval="step"`` scheduler after every optimizer step it
*called*, whether or not the loss scaler then skipped it for inf/NaN gradients, so a run with
overflows decays its learning rate ahead of the weights (Lightning issues 5558, 16228, 18828,
21339). :class:`SkipAwareScheduler` wraps such a scheduler: its ``step()`` is passed through only
when the scheduler's optimizer stepped. The Trainer precision plug-ins install it through
``Precision.connect`` (:meth:`~distamp.integrations.lightning.base.TrainerPrecisionBase.connect`),
the hook every Lightning strategy calls with the scheduler configurations, so no Lightning code is
patched.

Checkpoints are unchanged: ``state_dict``/``load_state_dict`` are the wrapped scheduler's own,
so a checkpoint written with the wrapper loads without it and the other way round.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.optim import Optimizer

__all__ = ["SkipAwareScheduler"]


class SkipAwareScheduler:
    """Pass ``step()`` to a scheduler only when its optimizer's last step was not skipped.

    Every other attribute (``optimizer``, ``get_last_lr()``, ``last_epoch``, ``base_lrs``...) is
    read from the wrapped scheduler, so Lightning's ``LearningRateMonitor`` and user code that
    reads the learning rate see the real scheduler. ``isinstance`` checks against torch's
    scheduler classes see the wrapper: use :attr:`scheduler` for those.

    Args:
        scheduler: the scheduler to gate (anything with ``step``, ``state_dict``,
            ``load_state_dict`` and an ``optimizer`` attribute).
        skipped: ``skipped(optimizer)`` says whether that optimizer's last step was skipped on
            every rank. It is asked once per ``step()``; the plugins' version reads one device
            flag (a host sync, only at steps where a scheduler is due).

    Raises:
        TypeError: ``scheduler`` has no ``step``/``state_dict``/``load_state_dict``/``optimizer``,
            or ``skipped`` is not callable.
    """

    def __init__(self, scheduler: Any, skipped: Callable[[Optimizer], bool]) -> None:
        missing = [
            name
            for name in ("step", "state_dict", "load_state_dict", "optimizer")
            if not hasattr(scheduler, name)
        ]
        if missing:
            raise TypeError(
                f"scheduler={scheduler!r} is not a learning-rate scheduler: it has no "
                f"{', '.join(missing)}"
            )
        if not callable(skipped):
            raise TypeError(f"skipped={skipped!r} must be callable: skipped(optimizer) -> bool")
        # Set through __dict__: __getattr__ below must never see a half-built wrapper.
        self.__dict__["_scheduler"] = scheduler
        self.__dict__["_skipped"] = skipped
        self.__dict__["held_steps"] = 0

    held_steps: int
    """How many ``step()`` calls were withheld because the optimizer step was skipped."""

    @property
    def scheduler(self) -> Any:
        """The wrapped scheduler."""
        return self.__dict__["_scheduler"]

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Step the wrapped scheduler unless its optimizer's last step was skipped."""
        scheduler = self.scheduler
        if self.__dict__["_skipped"](scheduler.optimizer):
            self.__dict__["held_steps"] += 1
            return
        scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped scheduler's state (the wrapper itself keeps nothing worth restoring)."""
        return self.scheduler.state_dict()  # type: ignore[no-any-return]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the wrapped scheduler's state."""
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        # Only called for names the wrapper lacks. Reading __dict__ directly keeps copy/pickle
        # (which probe attributes before __init__ ran) from recursing.
        scheduler = self.__dict__.get("_scheduler")
        if scheduler is None:
            raise AttributeError(name)
        return getattr(scheduler, name)

    def __repr__(self) -> str:
        return f"SkipAwareScheduler({self.scheduler!r})"
