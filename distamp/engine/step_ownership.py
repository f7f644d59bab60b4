"""The engine alone steps the optimizer and the LR scheduler it was given.

:meth:`~distamp.DistAMP.step` steps the optimizer only when every rank agreed that the
gradients are finite (and the spike guard found no spike), and the scheduler only after a step
that was taken. A call of ``opt.step()`` left in the loop after ``amp.backward_and_step(loss)``
would apply a step the ranks agreed to skip, or the engine's step a second time; a scheduler
stepped by hand advances the learning rate past a skipped step. Both run silently and leave a
model that no longer follows the agreed decisions, so the engine refuses them:

- the optimizer: a step pre-hook on the optimizer :meth:`~distamp.DistAMP.setup` returned (and
  on the one given to it, and on a master-weight optimizer's inner one) raises before anything
  of a step outside the engine is applied, naming the call and the fix. The engine's own step
  runs inside :meth:`StepOwnership.engine_steps`, which the hook lets through; so does torch's
  materialisation of a fresh optimizer's state for ``torch.distributed.checkpoint`` (a step at
  learning rate zero that changes no parameter: :func:`~distamp.torch_compat.
  is_state_materialisation`).
- the scheduler: torch's schedulers keep no hooks, and wrapping ``step`` on the instance would
  put the wrapper into the scheduler's ``state_dict`` (it saves its ``__dict__``). So its
  ``last_epoch`` is compared with the engine's own count at each engine call
  (:meth:`StepOwnership.check`): a host integer, no device sync.

Plug-ins (Accelerate, Lightning, the Hugging Face Trainer) step the optimizer themselves and do
not go through the engine: they register no hook here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from distamp.optim import MasterWeightOptimizer
from distamp.torch_compat import is_state_materialisation, takes_step_hooks

__all__ = ["StepOwnership"]


class StepOwnership:
    """The engine's claim on its optimizer's and scheduler's steps (see the module doc).

    Armed by :meth:`arm` at setup, released by :meth:`release` at close. Costs one Python
    call per optimizer step (the pre-hook) and one integer comparison per engine call.
    """

    def __init__(self) -> None:
        self.handles: list[RemovableHandle] = []
        self.inside = False  # the engine's own step is running
        self.scheduler: Any = None
        self.epoch: int | None = None  # the scheduler's last_epoch as the engine left it

    def arm(self, optimizer: torch.optim.Optimizer, given: Any, scheduler: Any) -> None:
        """Refuse steps outside :meth:`engine_steps` of every optimizer whose step would change
        the model: ``optimizer`` (the one setup returns), ``given`` when it is an instance (the
        same one, or the one rebuilt for FSDP), and a master-weight optimizer's inner torch
        optimizer (it shares the parameter groups); and watch ``scheduler`` (``None``: none)."""
        optimizers = [optimizer]
        if isinstance(given, torch.optim.Optimizer):
            optimizers.append(given)
        if isinstance(optimizer, MasterWeightOptimizer):
            optimizers.append(optimizer.inner)
        wrapped = getattr(optimizer, "optim", None)  # torchft's OptimizerWrapper
        if isinstance(wrapped, torch.optim.Optimizer):
            optimizers.append(wrapped)
        seen: set[int] = set()
        for optimizer in optimizers:
            # an optimizer-like wrapper (torchft's OptimizerWrapper) subclasses Optimizer
            # without its hook table: the optimizer it wraps, also listed, carries the hook
            if id(optimizer) in seen or not takes_step_hooks(optimizer):
                continue
            seen.add(id(optimizer))
            self.handles.append(optimizer.register_step_pre_hook(self._refuse))
        self.scheduler = scheduler
        self.resync()

    def release(self) -> None:
        """Remove the hooks (at close: the optimizer may be used on without the engine)."""
        for handle in self.handles:
            handle.remove()
        self.handles, self.scheduler, self.epoch = [], None, None

    def resync(self) -> None:
        """Take the scheduler's count as the engine's own: after setup, after the engine
        stepped it, after a checkpoint restored it."""
        self.epoch = _epoch(self.scheduler)

    @contextmanager
    def engine_steps(self) -> Iterator[None]:
        """While open, the engine's own calls step the optimizer (and its inner one)."""
        self.inside = True
        try:
            yield
        finally:
            self.inside = False

    def check(self, call: str) -> None:
        """Before the engine call ``call``: ``RuntimeError`` when the scheduler was stepped
        outside the engine since the engine last stepped or restored it. The refusal stands
        until a checkpoint is loaded: the learning rate has moved and no engine step may run
        with it. No host sync (``last_epoch`` is a Python int)."""
        if self.epoch is None:
            return
        now = _epoch(self.scheduler)
        if now == self.epoch:
            return
        name = type(self.scheduler).__name__
        raise RuntimeError(
            f"DistAMP.{call}(): the LR scheduler ({name}) was stepped outside the engine "
            f"(its last_epoch is {now}, the engine left it at {self.epoch}). The engine steps "
            "it itself after each optimizer step the ranks took, so a step by hand advances "
            "the learning rate past a skipped step. Remove the `scheduler.step()` call from "
            "the loop (read the rate with `scheduler.get_last_lr()`), then restart or "
            "load_state() a checkpoint: the learning rate has already moved."
        )

    def _refuse(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """The step pre-hook: raising here stops ``optimizer.step`` before its body runs."""
        if self.inside or is_state_materialisation(optimizer, args, kwargs):
            return
        name = type(optimizer).__name__
        raise RuntimeError(
            f"{name}.step() called outside the engine: DistAMP steps the optimizer itself in "
            "step() / backward_and_step(), only when every rank agreed that the gradients are "
            "finite, so an extra step would apply a step the ranks skipped, or this one twice. "
            "Nothing was applied. Remove the extra `opt.step()` (and any `scaler.step(opt)`, "
            "`opt.zero_grad()`) from the loop and let the engine step; a loop that steps by "
            "itself uses distamp.DistributedGradScaler without DistAMP."
        )


def _epoch(scheduler: Any) -> int | None:
    """A scheduler's step count, or ``None`` when there is none to watch (no scheduler, or
    one without torch's ``last_epoch`` integer)."""
    epoch = getattr(scheduler, "last_epoch", None)
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None
