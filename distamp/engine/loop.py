"""The engine's training loop (:meth:`DistAMP.fit`) and its logging-step diagnosis.

Kept apart from :mod:`distamp.engine`, which owns the order of one step; this module owns the
order of a run: micro-batches, steps, logging windows, stop requests and periodic saves.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from distamp.cluster import is_distributed, named_collective
from distamp.observe.metrics import StepResult, WindowStats
from distamp.parallel.topology import is_pipeline_stage

if TYPE_CHECKING:
    from distamp.engine.core import DistAMP

__all__ = ["diagnose", "pipeline_loss_fn", "pipeline_stages", "run_pipeline_step", "train_loop"]


def train_loop(
    amp: DistAMP,
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
    """:meth:`DistAMP.fit` (see there for the arguments)."""
    n, stats, model = amp.config.grad_accum_steps, None, amp.model
    cfg_timeout = amp.config.timeout
    saved_at = amp.step_count  # a resumed run that has nothing left to do saves nothing
    while amp.step_count < steps:
        for micro in range(n):
            with amp.accumulate():
                with amp.autocast():
                    loss = loss_fn(model, batch(amp.step_count * n + micro))
                amp.backward(loss, tokens=tokens_per_batch)
        amp.step()
        done = amp.step_count
        if on_step is not None:
            on_step(done)
        if done % log_interval == 0 or done == steps:
            stop = bool(stop_requested()) if stop_requested is not None else False
            with named_collective("metrics collection at a logging step", cfg_timeout):
                stats = diagnose(amp, amp.metrics.collect(step=done, scaler=amp.scaler, stop=stop))
            if on_log is not None:
                on_log(stats)
            if stats.stop:
                break
        if checkpoint_dir is not None and checkpoint_interval and done % checkpoint_interval == 0:
            amp.save_state(checkpoint_dir)
            saved_at = done
    if checkpoint_dir is not None and saved_at != amp.step_count:
        amp.save_state(checkpoint_dir)
    return stats


def diagnose(amp: DistAMP, stats: WindowStats) -> WindowStats:
    """At a logging step whose window skipped: the overflow report (collective; every rank
    takes this branch, the stats being identical) and, on rank 0, the scale-health warning."""
    if stats.skipped_steps == amp._skips_seen or not amp.scaler.is_enabled():
        amp._health.check(skipped_in_a_row=0, scale=stats.loss_scale, report=None)
        return stats
    amp._skips_seen = stats.skipped_steps
    report = amp.scaler.overflow_report()
    if amp.fp8 is not None:  # names the fp8 layers among the report's
        report = amp.fp8.annotate(report)
    streak = amp.scaler.skip_streak
    text = amp._health.check(skipped_in_a_row=streak, scale=stats.loss_scale, report=report)
    if text is not None and (not is_distributed() or dist.get_rank() == 0):
        warnings.warn(text, RuntimeWarning, stacklevel=4)
    return replace(stats, overflow=None if report is None else report.one_line())


def pipeline_loss_fn(
    amp: DistAMP, loss_fn: Callable[..., torch.Tensor]
) -> Callable[..., torch.Tensor]:
    """:meth:`DistAMP.scaled_loss_fn`: records each micro-batch loss, then scales it."""
    if amp.config.grad_accum_steps != 1:
        raise ValueError(
            f"grad_accum_steps={amp.config.grad_accum_steps}: under a pipeline schedule the "
            "schedule's micro-batches are the accumulation; use grad_accum_steps=1 and "
            "n_microbatches in the schedule"
        )

    def recorded(*args: Any, **kwargs: Any) -> torch.Tensor:
        loss = loss_fn(*args, **kwargs)
        amp.metrics.record(loss)
        return loss

    return amp.scaler.scaled_loss_fn(recorded)


def run_pipeline_step(amp: DistAMP, schedule: Any, *args: Any, **kwargs: Any) -> StepResult:
    """:meth:`DistAMP.pipeline_step`: the schedule's iteration under autocast, then the step."""
    if amp._micro:
        raise RuntimeError(
            "pipeline_step() after backward(): a pipeline schedule runs its own backward"
        )
    timeout = amp.config.timeout
    with amp.autocast(), named_collective("pipeline schedule (stage send/recv)", timeout):
        schedule.step(*args, **kwargs)
    amp._micro = amp.config.grad_accum_steps
    return amp.step()


def pipeline_stages(model: Any) -> tuple[list[Any], nn.Module]:
    """``(stages, module to train)`` for what :meth:`~distamp.DistAMP.setup` was given: no stage
    and the model itself, one ``torch.distributed.pipelining`` stage and its module, or a list
    of this rank's stages and a ``ModuleDict`` of their modules keyed by global stage index."""
    if is_pipeline_stage(model):
        return [model], model.submod
    if isinstance(model, (list, tuple)):
        if not model or not all(is_pipeline_stage(s) for s in model):
            kinds = sorted({type(s).__name__ for s in model}) or ["nothing"]
            raise ValueError(
                "setup(): a list must hold this rank's torch.distributed.pipelining stages "
                f"(several for interleaved schedules), got {', '.join(kinds)}"
            )
        indices = [s.stage_index for s in model]
        if len(set(indices)) != len(indices):
            raise ValueError(f"setup(): the stages' indices repeat: {indices}")
        return list(model), nn.ModuleDict({f"stage{s.stage_index}": s.submod for s in model})
    return [], model
