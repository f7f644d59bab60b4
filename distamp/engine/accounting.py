"""The engine's step accounting: where a step is in its accumulation cycle (and what may be
called when), which skipped steps were already reported, and the release of a finished cycle's
gradients.

Two small records that :class:`~distamp.DistAMP` owns and the run loop
(:mod:`distamp.engine.loop`) asks: the loop drives micro-batches and logging windows but never
counts them itself, so the call-order rules and the skip reports have one home.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from distamp.arguments import ArgumentTypeError, integer_or_none
from distamp.cluster import is_distributed
from distamp.observe.diagnostics import ScaleHealth
from distamp.observe.metrics import WindowStats
from distamp.precision.fp8 import Float8Training
from distamp.scaler import DistributedGradScaler

__all__ = ["MicroBatchCycle", "SkipReports", "release_grads"]


class MicroBatchCycle:
    """The ``backward()`` calls of the current optimizer step, and the order they impose:
    ``grad_accum_steps`` backward calls, then one step (a pipeline schedule runs them all).

    Args:
        grad_accum_steps: micro-batches per optimizer step (validated by the engine's config).
    """

    def __init__(self, grad_accum_steps: int) -> None:
        self.size = grad_accum_steps
        self.done = 0  # backward() calls since the last step()
        self.first = True  # no backward() has run yet (a static-graph DDP must sync it)

    @property
    def is_last(self) -> bool:
        """Whether the next backward completes the cycle (then the step is due)."""
        return self.done + 1 >= self.size

    @property
    def complete(self) -> bool:
        """Whether every micro-batch of the cycle has run its backward."""
        return self.done == self.size

    @staticmethod
    def require_setup(call: str, *, set_up: bool) -> None:
        """Before ``call`` (``autocast``, ``accumulate``, ``backward``): ``RuntimeError`` naming
        ``setup`` unless the engine has a model. Without it the mistake would surface only at
        the optimizer step, after a forward (outside autocast: in fp32) and a backward ran."""
        if not set_up:
            raise RuntimeError(
                f"DistAMP.{call}() with no model set up: call `model, optimizer = "
                "amp.setup(model, optimizer)` first (it wraps the model and builds the scaler) "
                "and train the model it returns; after close(), build a new DistAMP"
            )

    def check_backward(self, loss: Any, tokens: Any, *, set_up: bool) -> int:
        """Before a backward: the engine is set up (:meth:`require_setup`), ``loss`` is one
        number and ``tokens`` a count (``TypeError``/``ValueError``, before anything changed),
        and the cycle is not already complete (``RuntimeError``). Returns ``tokens`` as an int.
        """
        self.require_setup("backward", set_up=set_up)
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"backward(loss=...): expected the loss tensor autograd built in the forward, "
                f"got {type(loss).__name__}: {loss!r:.80}"
            )
        if loss.numel() != 1:
            raise ValueError(
                f"backward(loss=...): a tensor of shape {tuple(loss.shape)}; pass one number, "
                "this micro-batch's mean loss (e.g. loss.mean(), or reduction='mean')"
            )
        count = integer_or_none(tokens)
        if count is None or count < 0:
            raise (ArgumentTypeError if count is None else ValueError)(
                f"backward(tokens={tokens!r}): the number of tokens in this micro-batch, a whole "
                "number >= 0 (0 when not counted)"
            )
        if self.done >= self.size:
            raise RuntimeError(
                f"backward() called {self.done + 1} times since the last step() with "
                f"grad_accum_steps={self.size}: call step() after every {self.size} backward() "
                "calls"
            )
        return count

    def backward_done(self) -> None:
        self.done += 1
        self.first = False

    def check_step(self) -> None:
        """Before a step: raise ``RuntimeError`` unless the cycle is complete."""
        if self.done != self.size:
            raise RuntimeError(
                f"step() after {self.done} of grad_accum_steps={self.size} backward() calls: call "
                "backward() once per micro-batch, then step() once per cycle"
            )

    def require_idle(self, message: str) -> None:
        """Raise ``RuntimeError(message)`` in the middle of a cycle (some backward ran)."""
        if self.done:
            raise RuntimeError(message)

    def fill(self) -> None:
        """A pipeline schedule ran every micro-batch's backward itself."""
        self.done = self.size

    def reset(self) -> None:
        """After the step: the next cycle begins."""
        self.done = 0


class SkipReports:
    """Which skipped steps were reported, and the scale-health warning, at logging steps.

    A window whose skip count grew since the last report gets the overflow report (which
    layers, which ranks; a collective, taken by every rank alike since the window's figures are
    identical) and, on rank 0, the scale-health warning when the scale keeps dropping or sits
    at its floor.
    """

    def __init__(self) -> None:
        self.health = ScaleHealth()
        self.seen = 0  # skipped steps already reported

    def arm(self, min_scale: float | None) -> None:
        """At setup: the scale's floor, for the "at floor" warning."""
        self.health = ScaleHealth(min_scale=min_scale)

    def restored(self, skipped_steps: int) -> None:
        """After loading a checkpoint: its skips are not new ones."""
        self.seen = skipped_steps

    def diagnose(
        self,
        stats: WindowStats,
        scaler: DistributedGradScaler,
        fp8: Float8Training | None = None,
    ) -> WindowStats:
        """``stats`` with its overflow line when the window skipped (see the class doc).

        Args:
            stats: the collected window.
            scaler: the engine's scaler.
            fp8: the engine's float8 layers, if any: names them among the report's.
        """
        if stats.skipped_steps == self.seen or not scaler.is_enabled():
            self.health.check(skipped_in_a_row=0, scale=stats.loss_scale, report=None)
            return stats
        self.seen = stats.skipped_steps
        report = scaler.overflow_report()
        if fp8 is not None:
            report = fp8.annotate(report)
        streak = scaler.skip_streak
        text = self.health.check(skipped_in_a_row=streak, scale=stats.loss_scale, report=report)
        if text is not None and (not is_distributed() or dist.get_rank() == 0):
            warnings.warn(text, RuntimeWarning, stacklevel=3)
        return replace(stats, overflow=None if report is None else report.one_line())


def release_grads(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.zero_grad(set_to_none=True)``: every parameter's gradient set to ``None``.

    When the optimizer keeps torch's own ``zero_grad``, the same assignments are made here
    directly: torch's method also opens a profiler range and passes a Dynamo guard on every
    call, which cost more than the loop itself (120-140 us against 20-30 us for the small GPT's
    53 parameters on the CPU, torch 2.13, right after the step's gradient passes). An optimizer
    whose ``zero_grad`` is its own (a class override, or one set on the instance, such as a
    wrapper that also starts the next quorum) gets it called.
    """
    own = getattr(optimizer.zero_grad, "__func__", None) is not torch.optim.Optimizer.zero_grad
    if own:
        optimizer.zero_grad(set_to_none=True)
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = None
