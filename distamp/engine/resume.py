"""What :meth:`DistAMP.load_state` restores besides the tensors, checked before anything moves.

A checkpoint's ``trainer.pt`` holds the step counter, the scaler, the scheduler, the adaptive
records and the precision that wrote it. :func:`plan_resume` checks every field (type, range,
consistency with this engine: a scaler state the scaler accepts, a scheduler state of the same
scheduler, adaptive records of modules this model has) and returns a :class:`ResumePlan`; only
when the whole checkpoint passed are the tensors read in place and the plan applied. So a refused
load changes nothing: not the model, not the optimizer, not the step counter.

Precision changes between the saving run and this one are converted explicitly, never applied
silently: a loss scale means something only to an fp16 scaler, so a scale saved by fp16 is not
handed to a bf16/fp8 run's check-only scaler (whose fused step would divide every gradient by
it), and a bf16 run's scale of 1 is not handed to an fp16 scaler (it would start 65536 times too
low). The scaler then starts afresh at this precision's initial scale, and a log line says so.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from distamp.cluster import is_distributed
from distamp.engine.accounting import SkipReports
from distamp.engine.checkpoint import CheckpointRead
from distamp.engine.checkpoint_layout import unreadable
from distamp.engine.guards import SpikeWatch
from distamp.parallel.comm_hooks import check_comm_state
from distamp.precision.policy import Precision, parse_precision
from distamp.scaler import DistributedGradScaler

__all__ = ["ResumePlan", "check_resume", "plan_resume"]

_log = logging.getLogger("distamp.engine")
_KNOWN = frozenset({"step", "scaler", "scheduler", "adaptive", "precision", "meta", "spike_guard"})


@dataclass(frozen=True)
class ResumePlan:
    """The checked trainer state of a checkpoint, ready to apply."""

    step: int
    scaler: dict[str, Any] | None  # normalised; None: the scaler keeps its state
    scheduler: dict[str, Any] | None  # None: the scheduler keeps its state
    adaptive: dict[str, Any] | None
    note: str | None  # what was converted (precision change), logged when applied
    spike_guard: dict[str, Any] | None = None  # the spike guard's history; None: kept

    def apply(
        self, scaler: DistributedGradScaler, scheduler: Any, adaptive: Any, skips: SkipReports
    ) -> int:
        """Restore the checked state into the engine's parts; returns the step counter."""
        if self.scaler is not None:
            scaler.load_state_dict(self.scaler)
            skips.restored(scaler.skipped_steps)  # restored skips are not new ones
        if self.scheduler is not None:
            scheduler.load_state_dict(self.scheduler)
        if self.adaptive is not None:
            adaptive.load_state_dict(self.adaptive)
        if self.note is not None and (not is_distributed() or dist.get_rank() == 0):
            _log.warning("%s", self.note)
        return self.step


def check_resume(
    read: CheckpointRead,
    *,
    precision: Precision,
    scaler: DistributedGradScaler,
    scheduler: Any,
    adaptive: Any,
    comm_state: Any,
    spike: SpikeWatch | None = None,
) -> ResumePlan:
    """Everything of ``read`` that is specific to this engine, checked (the ``check`` of
    :func:`~distamp.engine.checkpoint.read_checkpoint`, so that the ranks agree on it): this
    rank's own state against the comm hook's, then the trainer state (:func:`plan_resume`).

    Raises:
        CheckpointError: this rank's ``rank_<r>.pt`` is not the comm hook's state (names it).
        ValueError: a trainer field is malformed or does not fit (names the file and field).
    """
    rank = dist.get_rank() if is_distributed() else 0
    try:
        check_comm_state(comm_state, read.rank_state)
    except ValueError as exc:
        why = f"not this run's comm hook state ({exc})"
        raise unreadable(read.path / f"rank_{rank}.pt", why, read.path.parent) from None
    trainer_file = read.path / "trainer.pt"
    return plan_resume(
        read.trainer,
        trainer_file,
        precision=precision,
        scaler=scaler,
        scheduler=scheduler,
        adaptive=adaptive,
        spike=spike,
    )


def _field(file: Path, name: str, why: str, value: Any) -> ValueError:
    return ValueError(f"checkpoint file {file}: field {name!r} {why}, got {value!r:.200}")


def plan_resume(
    trainer: Mapping[str, Any],
    file: Path,
    *,
    precision: Precision,
    scaler: DistributedGradScaler,
    scheduler: Any,
    adaptive: Any,
    spike: SpikeWatch | None = None,
) -> ResumePlan:
    """Check ``trainer`` (the contents of ``file``) against this engine; modifies nothing.

    Args:
        trainer: the trainer state read from ``file``.
        precision: this run's precision.
        scaler, scheduler: this engine's (``scheduler`` may be ``None``).
        adaptive: this engine's :class:`~distamp.precision.adaptive_run.AdaptiveRun` or ``None``.
        spike: this engine's :class:`~distamp.engine.guards.SpikeWatch` or ``None`` (a saved
            history without a guard here is not restored; a guard without one starts afresh).

    Raises:
        ValueError: a field is missing, of the wrong type or out of range, or does not fit this
            engine; the message names the file and the field.
    """
    unknown = sorted(set(trainer) - _KNOWN, key=str)
    if unknown:
        raise _field(file, unknown[0], "is not one distamp writes (another tool's file?)", unknown)
    for key in ("step", "scaler", "scheduler"):
        if key not in trainer:
            raise ValueError(
                f"checkpoint file {file} lacks the field {key!r}: not a distamp "
                "checkpoint, or a damaged one"
            )
    step = trainer["step"]
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 2**63:
        raise _field(file, "step", "must be an int in [0, 2**63 - 1]", step)
    saved_sd = trainer["scaler"]
    if not isinstance(saved_sd, dict):
        raise _field(file, "scaler", "must be a dict (a scaler's state_dict)", saved_sd)
    scaler_sd, note = _scaler_state(trainer, saved_sd, file, precision, scaler)
    sched = trainer["scheduler"]
    sched_sd = _scheduler_state(sched, scheduler, file)
    adaptive_sd = trainer.get("adaptive")
    if adaptive is not None and adaptive_sd is not None:
        if not isinstance(adaptive_sd, dict):
            raise _field(file, "adaptive", "must be a dict", adaptive_sd)
        try:
            adaptive.check_state_dict(adaptive_sd)
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"checkpoint file {file}: field 'adaptive': {exc}") from None
    else:
        adaptive_sd = None
    spike_sd = trainer.get("spike_guard")
    if spike is not None and spike_sd is not None:
        try:
            spike_sd = spike.check_state_dict(spike_sd)
        except ValueError as exc:
            raise ValueError(f"checkpoint file {file}: field 'spike_guard': {exc}") from None
    else:
        spike_sd = None
    return ResumePlan(step, scaler_sd, sched_sd, adaptive_sd, note, spike_sd)


def _saved_precision(trainer: Mapping[str, Any], saved_sd: dict[str, Any], file: Path) -> str:
    """The precision that wrote the checkpoint; inferred from the scaler's state for files
    written before it was recorded (an empty state or a scale of 1: no loss scaling)."""
    name = trainer.get("precision")
    if name is not None:
        if not isinstance(name, str):
            raise _field(file, "precision", "must be a precision name", name)
        try:
            return parse_precision(name).name
        except ValueError:
            raise _field(file, "precision", "is not a precision distamp knows", name) from None
    scale = saved_sd.get("scale")
    return "fp16" if saved_sd and scale != 1.0 else "bf16 or fp32"


def _scaler_state(
    trainer: Mapping[str, Any],
    saved_sd: dict[str, Any],
    file: Path,
    precision: Precision,
    scaler: DistributedGradScaler,
) -> tuple[dict[str, Any] | None, str | None]:
    saved = _saved_precision(trainer, saved_sd, file)
    if not scaler.is_enabled():  # a disabled scaler keeps no state
        return None, None
    scales_saved = saved == "fp16"
    if scales_saved != (not scaler.check_only):
        start = scaler.get_scale()  # host sync: one per load
        note = (
            f"checkpoint {file.parent} was saved in {saved} and this run trains in "
            f"{precision.name}: the loss scale is not carried over (it means something only "
            f"to a loss-scaling fp16 run); the scaler starts afresh at {start:g}, its skip "
            "counter at 0"
        )
        return None, note
    if not saved_sd:
        return None, None  # saved by a disabled scaler: nothing to restore
    try:
        return scaler.check_state_dict(saved_sd), None
    except (ValueError, RuntimeError) as exc:
        raise ValueError(f"checkpoint file {file}: field 'scaler': {exc}") from None


def _scheduler_state(saved: Any, scheduler: Any, file: Path) -> dict[str, Any] | None:
    if saved is None:
        if scheduler is not None:
            _log.warning(
                "checkpoint file %s holds no scheduler state: the scheduler starts afresh", file
            )
        return None
    if not isinstance(saved, dict):
        raise _field(file, "scheduler", "must be None or a dict (a scheduler's state_dict)", saved)
    if scheduler is None:
        _log.warning(
            "checkpoint file %s holds a scheduler state and this run has no scheduler: "
            "it is not restored (pass the scheduler to setup() to restore it)",
            file,
        )
        return None
    expected = set(scheduler.state_dict())
    if set(saved) != expected:
        raise _field(
            file,
            "scheduler",
            f"is the state of another scheduler: its keys differ from this "
            f"{type(scheduler).__name__}'s ({sorted(expected ^ set(saved))!r})",
            sorted(saved),
        )
    return saved
