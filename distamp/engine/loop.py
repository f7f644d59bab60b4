"""The engine's training loop (:meth:`DistAMP.fit`) and pipeline-schedule glue.

Kept apart from :mod:`distamp.engine.core`, which owns the order of one step; this module owns
the order of a run: micro-batches, steps, logging windows, stop requests and periodic saves.
It sees the engine through :class:`Engine` only, so it does not import the engine back.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from distamp.arguments import ArgumentTypeError, integer_or_none
from distamp.cluster import check_shared_directory, named_collective
from distamp.engine.accounting import MicroBatchCycle, SkipReports
from distamp.engine.config import AMPConfig
from distamp.engine.step_ownership import StepOwnership
from distamp.observe.metrics import Metrics, StepResult, WindowStats
from distamp.precision.fp8 import Float8Training
from distamp.scaler import DistributedGradScaler

__all__ = ["Engine", "RunLoop", "check_fit_arguments"]


class Engine(Protocol):
    """What the loop asks of the engine (:class:`~distamp.DistAMP` is one): its public face
    only, so that this module need not import the engine that calls it."""

    config: AMPConfig
    step_count: int
    cycle: MicroBatchCycle
    skips: SkipReports
    metrics: Metrics
    scaler: DistributedGradScaler
    fp8: Float8Training | None
    ownership: StepOwnership

    @property
    def model(self) -> nn.Module: ...

    def accumulate(self) -> AbstractContextManager[None]: ...

    def autocast(self) -> AbstractContextManager[Any]: ...

    def backward(self, loss: torch.Tensor, *, tokens: int = 0) -> None: ...

    def step(self) -> StepResult: ...

    def collect_metrics(self, *, stop: bool = False) -> WindowStats: ...

    def save_state(self, directory: str | Path, *, keep: int = 2) -> Path: ...


class RunLoop:
    """The run-level entry points of :class:`~distamp.DistAMP`: :meth:`fit` (micro-batches,
    steps, logging windows, stop requests, periodic saves) and the pipeline-schedule glue.

    A base of the engine, written against the :class:`Engine` protocol only: the loop drives
    the step-level methods and never reaches into how they count or decide.
    """

    def fit(
        self: Engine,
        batch: Callable[[int], Any],
        loss_fn: Callable[[nn.Module, Any], torch.Tensor],
        *,
        steps: int,
        tokens_per_batch: int = 0,
        log_interval: int = 10,
        on_log: Callable[[WindowStats], None] | None = None,
        on_step: Callable[[int], None] | None = None,
        stop_requested: Callable[[], bool] | None = None,
        checkpoint_dir: str | Path | None = None,
        checkpoint_interval: int = 0,
    ) -> WindowStats | None:
        """Train from :attr:`step_count` up to ``steps`` optimizer steps.

        Args:
            batch: ``batch(k)`` returns this rank's micro-batch number ``k`` (counted over the
                whole run). An index rather than an iterator makes a resumed run draw exactly the
                batches an uninterrupted one would, with no loader state to save.
            loss_fn: ``loss_fn(model, batch)`` returns the mean loss; it runs under autocast.
            steps: the optimizer step to stop at.
            tokens_per_batch: tokens in one micro-batch, for the throughput figure.
            log_interval: collect metrics (one collective, a few host syncs) every this many
                steps and at the end.
            on_log: called on every rank with each collected window.
            on_step: called after every step with the step count (e.g. a progress bar).
            stop_requested: polled at each logging step (e.g. a signal flag); if it is true on
                any rank, every rank stops there, saves (with ``checkpoint_dir``) and returns.
            checkpoint_dir: where to save every ``checkpoint_interval`` steps and at the end;
                one filesystem shared by every rank, checked before the first step
                (:func:`~distamp.cluster.check_shared_directory`: a probe file per rank).
            checkpoint_interval: steps between saves; 0: only at the end.

        Returns:
            The last collected window (``None`` if there was nothing to do).

        Raises:
            TypeError, ValueError: a bad argument, named, before anything ran
                (:func:`check_fit_arguments`); a ``checkpoint_dir`` that not every rank sees
                (``ValueError`` on every rank, before the first step).
        """
        args = check_fit_arguments(
            batch=batch,
            loss_fn=loss_fn,
            steps=steps,
            tokens_per_batch=tokens_per_batch,
            log_interval=log_interval,
            on_log=on_log,
            on_step=on_step,
            stop_requested=stop_requested,
            checkpoint_dir=checkpoint_dir,
            checkpoint_interval=checkpoint_interval,
        )
        self.ownership.check("fit")  # a scheduler stepped by hand before the run
        steps, tokens_per_batch = args["steps"], args["tokens_per_batch"]
        log_interval, checkpoint_interval = args["log_interval"], args["checkpoint_interval"]
        n, stats, model = self.config.grad_accum_steps, None, self.model
        cfg_timeout = self.config.timeout
        if checkpoint_dir is not None:  # node-local disks: refused now, not at the first save
            with named_collective("fit: checkpoint_dir seen by every rank?", cfg_timeout):
                check_shared_directory(checkpoint_dir)
        saved_at = self.step_count  # a resumed run that has nothing left to do saves nothing
        while self.step_count < steps:
            for micro in range(n):
                with self.accumulate():
                    with self.autocast():
                        loss = loss_fn(model, batch(self.step_count * n + micro))
                    self.backward(loss, tokens=tokens_per_batch)
            self.step()
            done = self.step_count
            if on_step is not None:
                on_step(done)
            if done % log_interval == 0 or done == steps:
                stop = bool(stop_requested()) if stop_requested is not None else False
                stats = self.collect_metrics(stop=stop)
                if on_log is not None:
                    on_log(stats)
                if stats.stop:
                    break
            if (
                checkpoint_dir is not None
                and checkpoint_interval
                and done % checkpoint_interval == 0
            ):
                self.save_state(checkpoint_dir)
                saved_at = done
        if checkpoint_dir is not None and saved_at != self.step_count:
            self.save_state(checkpoint_dir)
        return stats

    def collect_metrics(self: Engine, *, stop: bool = False) -> WindowStats:
        """Close the metrics window at a logging step: what :meth:`fit` logs, for a hand loop
        over :meth:`backward_and_step` (hand it to :meth:`distamp.MetricsRecorder.log` for the
        report's ``metrics.jsonl``). The window holds the steps since the previous call.

        Collective (one all-reduce; the overflow report's gather when the window skipped) with
        the reducer's host reads: call it on every rank at the same step.

        Args:
            stop: this rank's wish to stop; the window's ``stop`` is true if any rank wished it.
        """
        with named_collective("metrics collection at a logging step", self.config.timeout):
            stats = self.metrics.collect(step=self.step_count, scaler=self.scaler, stop=stop)
            return self.skips.diagnose(stats, self.scaler, self.fp8)

    def scaled_loss_fn(
        self: Engine, loss_fn: Callable[..., torch.Tensor]
    ) -> Callable[..., torch.Tensor]:
        """The ``loss_fn`` to build a ``torch.distributed.pipelining`` schedule with.

        Each micro-batch loss (on the last stage) is recorded for the metrics, unscaled, then
        scaled, so the schedule's backward yields scaled gradients on every stage; the schedule
        keeps its own micro-batch averaging. Call on every rank (stages without a loss step too).
        """
        if self.config.grad_accum_steps != 1:
            raise ValueError(
                f"grad_accum_steps={self.config.grad_accum_steps}: under a pipeline schedule the "
                "schedule's micro-batches are the accumulation; use grad_accum_steps=1 and "
                "n_microbatches in the schedule"
            )

        def recorded(*args: Any, **kwargs: Any) -> torch.Tensor:
            loss = loss_fn(*args, **kwargs)
            self.metrics.record(loss)
            return loss

        return self.scaler.scaled_loss_fn(recorded)

    def pipeline_step(self: Engine, schedule: Any, *args: Any, **kwargs: Any) -> StepResult:
        """One pipeline-schedule iteration (every micro-batch's forward and backward, under this
        engine's autocast), then :meth:`step`: the whole model's norm, one skip decision for all
        stages. ``args``/``kwargs`` go to ``schedule.step`` (inputs first, ``target=`` last)."""
        self.cycle.require_idle(
            "pipeline_step() after backward(): a pipeline schedule runs its own backward"
        )
        self.ownership.check("pipeline_step")
        timeout = self.config.timeout
        with self.autocast(), named_collective("pipeline schedule (stage send/recv)", timeout):
            schedule.step(*args, **kwargs)
        self.cycle.fill()
        return self.step()


# fit's whole-number arguments: the least value, and what the number is.
_FIT_COUNTS = {
    "steps": (0, "the optimizer step to stop at"),
    "tokens_per_batch": (0, "tokens in one micro-batch (0: not counted)"),
    "log_interval": (1, "optimizer steps between metrics collections"),
    "checkpoint_interval": (0, "optimizer steps between saves (0: only at the end)"),
}
_FIT_CALLABLES = ("batch", "loss_fn", "on_log", "on_step", "stop_requested")


def check_fit_arguments(**given: Any) -> dict[str, Any]:
    """:meth:`RunLoop.fit`'s arguments checked whole, before the first step: a bad one would
    otherwise fail steps later (``log_interval=0``: a ``ZeroDivisionError`` after the first
    step; a string callback: at the first logging step). Returns them with the counts as ints.

    Raises:
        ArgumentTypeError: (a ``TypeError`` and a ``ValueError``) a count that is no whole
            number, a callback that is not callable, a ``checkpoint_dir`` that is not a path.
        ValueError: a count below its least value.
    """
    out = dict(given)
    for name, (low, what) in _FIT_COUNTS.items():
        count = integer_or_none(given[name])
        if count is None or count < low:
            raise (ArgumentTypeError if count is None else ValueError)(
                f"fit({name}={given[name]!r}): {what}; give a whole number >= {low}"
            )
        out[name] = count
    for name in _FIT_CALLABLES:
        optional = name not in ("batch", "loss_fn")
        if not callable(given[name]) and not (optional and given[name] is None):
            raise ArgumentTypeError(
                f"fit({name}={given[name]!r:.80}): expected a function"
                + (" or None" if optional else "")
            )
    folder = given["checkpoint_dir"]
    if folder is not None and not isinstance(folder, (str, os.PathLike)):
        raise ArgumentTypeError(f"fit(checkpoint_dir={folder!r:.80}): expected a path or None")
    return out
