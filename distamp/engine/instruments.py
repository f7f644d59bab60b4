"""The engine's numerics and diagnostics: what watches a run without changing its step.

Two instruments, both optional and both tied to the scaler's step boundaries: the non-finite
tracer (``trace_nonfinite=True``: forward hooks that find the first module whose output went
inf/NaN, reported with a skipped step, :mod:`distamp.observe.diagnostics`) and the adaptive run
(the numeric monitor of ``numerics_interval``, and an adaptive policy's promotions and backward
scales, :mod:`distamp.precision.adaptive_run`). Built at ``DistAMP.setup`` over the unwrapped
model (its module names, not the wrapper's), detached at ``close``; kept apart from
:mod:`distamp.engine.core`, whose step only reads what they report.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from distamp.engine.config import AMPConfig
from distamp.observe.diagnostics import NonFiniteTracer
from distamp.precision.adaptive_run import AdaptiveRun
from distamp.precision.patterns import job_modules
from distamp.scaler import DistributedGradScaler

__all__ = ["attach_tracer", "build_adaptive", "detach_instruments"]


def attach_tracer(model: nn.Module, scaler: DistributedGradScaler) -> NonFiniteTracer:
    """Hooks on ``model`` (the unwrapped one: its module names) that record where a forward
    first went non-finite; ``scaler`` keeps the record of a skipped step for its overflow
    report. Costs ~4% of the main job's step on CPU."""
    tracer = NonFiniteTracer(model)
    scaler.attach_tracer(tracer)
    return tracer


def build_adaptive(
    model: nn.Module,
    cfg: AMPConfig,
    *,
    scaler: DistributedGradScaler,
    step: int,
    job: tuple[Any, ...] | None,
    stages: list[Any],
) -> AdaptiveRun | None:
    """The numeric monitor and adaptive rules over ``model`` (the unwrapped one: its module
    names), watching ``scaler``'s steps from ``step`` on; ``None`` when the policy asks for
    neither and no ``numerics_interval`` or ``telemetry`` is set (without a
    ``numerics_interval``, the telemetry's interval is the monitor's). ``job``: every stage's
    modules, so that name patterns match across pipeline stages; ``stages``: this rank's
    pipeline stages, if any (one at most with a monitor: the first's index places this rank in
    the job's segments)."""
    interval = cfg.numerics_interval
    if interval is None and cfg.telemetry is not None:
        interval = cfg.telemetry.interval
    with job_modules(job):
        run = AdaptiveRun.build(
            model,
            precision=cfg.precision,
            policy=cfg.policy,
            scaler=scaler,
            interval=interval,
            step=step,
            stage=stages[0].stage_index if stages else None,
        )
    if run is not None:
        run.telemetry = cfg.telemetry  # every report kept, per rank
    return run


def detach_instruments(
    scaler: DistributedGradScaler, tracer: NonFiniteTracer | None, adaptive: AdaptiveRun | None
) -> None:
    """Remove the tracer's hooks and detach it from ``scaler``, and close the adaptive run (its
    hooks and its hold on the scaler), so that neither outlives the engine."""
    if tracer is not None:
        tracer.remove()
        scaler.attach_tracer(None)
    if adaptive is not None:
        adaptive.close()
        if adaptive.telemetry is not None:
            adaptive.telemetry.close()  # its writers' files
